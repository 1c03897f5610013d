"""Each stage declares the config keys it reads once (components/config/stages.py): dvc.yaml's params, the Prefect
cache keys and the resume fingerprint follow from those declarations, and this test keeps dvc.yaml in step."""

from pathlib import Path

import pytest
import yaml

from components.config import flatten
from components.config.stages import STAGES
from components.validate import load_checked

ROOT = Path(__file__).resolve().parents[3]


def dvc_params(stage: str, file: str = "dvc.yaml") -> list[str]:
    spec = yaml.safe_load((ROOT / file).read_text())["stages"][stage]
    return [key for entry in spec.get("params", []) for keys in entry.values() for key in keys]


@pytest.mark.parametrize(
    ("file", "prefix"),
    [
        ("dvc.yaml", ""),
        ("vlm/dvc.yaml", ""),
        ("environments/dvc.yaml", ""),
        ("environments/dvc.yaml", "game_"),
        ("distill/dvc.yaml", ""),
        ("distill/dvc.yaml", "grpo_"),
    ],
)
@pytest.mark.parametrize("stage", list(STAGES))
def test_dvc_params_are_exactly_the_declared_keys(stage, file, prefix):
    stages = yaml.safe_load((ROOT / file).read_text())["stages"]
    if (
        file == "distill/dvc.yaml" and prefix + stage not in stages
    ):  # it starts from the default pipeline's data
        assert stage in ("prepare", "clean") or (prefix, stage) == ("grpo_", "sft")
        return
    assert sorted(dvc_params(prefix + stage, file)) == sorted(STAGES[stage].reads)


def test_every_declared_key_exists_in_the_config_and_the_params_file():
    """DVC reads each param from configs/arith_grpo.yaml: a key missing there is one DVC cannot track."""
    defaults = load_checked(None)
    in_file = flatten(load_checked(ROOT / "configs" / "arith_grpo.yaml"))
    raw = yaml.safe_load((ROOT / "configs" / "arith_grpo.yaml").read_text())
    for stage, keys in STAGES.items():
        for key in keys.reads:
            node = defaults  # a field of the config (a mapping such as reward_model.sources may be empty)
            for part in key.split("."):
                assert hasattr(node, part), (stage, key)
                node = getattr(node, part)
            node = raw
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, (
                    f"{stage}: {key} is not in configs/arith_grpo.yaml"
                )
                node = node[part]
    assert in_file


def test_the_cache_keys_and_the_fingerprint_come_from_the_declarations():
    from components.config.loader import training_keys
    from tasks.data import CLEAN_CACHE, PREPARE_CACHE
    from tasks.evaluate import EVAL_CACHE
    from tasks.sft import SFT_CACHE

    assert (
        PREPARE_CACHE.config_keys,
        CLEAN_CACHE.config_keys,
        SFT_CACHE.config_keys,
        EVAL_CACHE.config_keys,
    ) == tuple(STAGES[s].reads for s in ("prepare", "clean", "sft", "evaluate"))
    keys = training_keys(load_checked(None))
    assert "algorithm.clip_epsilon" in keys and "data.batch_size" in keys and "trainer.seed" in keys
    assert not {"trainer.iterations", "trainer.num_workers", "sft.steps", "data.num_train"} & set(keys)


@pytest.mark.parametrize("file", ["dvc.yaml", "vlm/dvc.yaml", "environments/dvc.yaml"])
def test_every_dependency_is_in_the_checkout_or_made_by_a_stage(file):
    spec = yaml.safe_load((ROOT / file).read_text())
    wdir = (ROOT / file).parent / spec["stages"]["prepare"].get("wdir", ".")
    outs = {
        (next(iter(o)) if isinstance(o, dict) else o)
        for stage in spec["stages"].values()
        for o in stage.get("outs", [])
    }
    for name, stage in spec["stages"].items():
        for dep in stage.get("deps", []):
            made = any(dep == o or dep.startswith(o + "/") for o in outs)
            assert made or (wdir / dep).exists(), f"{file}: stage {name} depends on {dep}, which is not there"
