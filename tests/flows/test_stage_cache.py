"""9. Finished stages are not redone: a flow run retried after a failure gets prepare/clean/sft/evaluate back
from the persisted results (state Cached) without running their bodies; a changed input file, config key or a
deleted output runs the stage again."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect import flow

from tasks.data import clean_data, prepare_data
from tasks.evaluate import evaluate_model
from tasks.sft import run_sft
from tests.flows.conftest import small_overrides

CONFIG = "configs/arith_grpo.yaml"


def mtimes(*paths: Path) -> list[int]:
    return [p.stat().st_mtime_ns for p in paths]


def test_a_retried_flow_run_takes_finished_stages_from_the_cache(tmp_path, prefect_harness):
    from components.validate import load_checked

    cfg = load_checked(CONFIG, small_overrides(tmp_path) + ["sft.steps=5"])
    attempts: list[dict] = []

    @flow(retries=1, retry_delay_seconds=0)
    def pipeline() -> None:
        states = {
            "prepare": prepare_data(cfg, return_state=True),
            "clean": clean_data(cfg, return_state=True),
            "sft": run_sft(cfg, return_state=True),
        }
        states["eval"] = evaluate_model(cfg.sft.output_dir, cfg.data.eval_path, cfg, return_state=True)
        attempts.append({k: s.name for k, s in states.items()})
        if len(attempts) == 1:
            raise ConnectionError("the machine went away after the stages finished")  # the run fails here

    pipeline()
    assert attempts == [
        {"prepare": "Completed", "clean": "Completed", "sft": "Completed", "eval": "Completed"},
        {"prepare": "Cached", "clean": "Cached", "sft": "Cached", "eval": "Cached"},
    ]


def test_changed_inputs_and_deleted_outputs_run_the_stage_again(tmp_path, prefect_harness):
    from components.validate import load_checked

    ov = small_overrides(tmp_path)
    cfg = load_checked(CONFIG, ov)
    raw, clean = Path(cfg.data.raw_dir) / "train.parquet", Path(cfg.data.train_path)

    @flow
    def data(cfg) -> tuple[str, str]:
        return prepare_data(cfg, return_state=True).name, clean_data(cfg, return_state=True).name

    assert data(cfg) == ("Completed", "Completed")
    before = mtimes(raw, clean)
    assert (
        data(cfg) == ("Cached", "Cached") and mtimes(raw, clean) == before
    )  # bodies not run: files untouched

    clean.unlink()  # an output gone (as `dvc repro` deletes it before rerunning the stage)
    assert data(cfg) == ("Cached", "Completed") and clean.is_file()

    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(raw).slice(1), raw)  # clean's input edited: clean runs again on it
    assert data(cfg) == ("Cached", "Completed")  # (an output edited in place is DVC's to catch, not a rerun)
    # a key only clean reads re-runs clean alone (prepare declares the keys it reads: components/config/stages.py)
    assert data(load_checked(CONFIG, ov + ["data.max_prompt_len=15"])) == ("Cached", "Completed")
    assert data(load_checked(CONFIG, ov + ["data.num_eval=15"])) == ("Completed", "Completed")


@pytest.mark.parametrize("key", ["trainer.seed=1"])
def test_the_cache_key_names_the_config_the_stage_reads(tmp_path, prefect_harness, key):
    from components.validate import load_checked

    cfg = load_checked(CONFIG, small_overrides(tmp_path))
    other = load_checked(CONFIG, small_overrides(tmp_path) + [key])
    unrelated = load_checked(CONFIG, small_overrides(tmp_path) + ["trainer.iterations=9"])

    @flow
    def prep(cfg) -> str:
        return prepare_data(cfg, return_state=True).name

    assert [prep(cfg), prep(unrelated), prep(other)] == ["Completed", "Cached", "Completed"]


def test_a_run_writing_elsewhere_is_not_served_another_locations_result(tmp_path, prefect_harness):
    """Two configs alike but for where prepare writes (data.raw_dir), the second's directory already holding
    files (stale data from before a config change): it runs the stage and writes there, instead of being
    handed the first one's result, which names the first one's files."""
    import shutil

    from components.validate import load_checked

    a = load_checked(CONFIG, small_overrides(tmp_path / "a"))
    b = load_checked(CONFIG, small_overrides(tmp_path / "b"))  # the same config keys, other paths

    @flow
    def prep(cfg) -> tuple[str, list[str]]:
        state = prepare_data(cfg, return_state=True)
        return state.name, state.result()

    name, written = prep(a)
    assert name == "Completed" and all(Path(p).is_relative_to(a.data.raw_dir) for p in written)
    shutil.copytree(a.data.raw_dir, b.data.raw_dir)  # b's outputs are there, but not b's to take
    (Path(b.data.raw_dir) / "train.parquet").write_bytes(b"stale")
    name, written = prep(b)
    assert name == "Completed" and all(Path(p).is_relative_to(b.data.raw_dir) for p in written)
    assert (Path(b.data.raw_dir) / "train.parquet").read_bytes() != b"stale"
    assert prep(b)[0] == prep(a)[0] == "Cached"  # each location keeps a result of its own


def test_another_checkout_never_gets_this_ones_cached_results(tmp_path, prefect_api):
    """Two checkouts of the project on one machine, the same stage with the same config: each runs it once
    (its results persist under its own .prefect-results), and neither is served the other's result."""
    import os
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True).stdout.split()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_RESULTS_LOCAL_STORAGE_PATH"}  # as a new shell
    env.update(PREFECT_API_URL=prefect_api, PYTHONPATH="")
    outputs = {}
    for name in ("a", "b", "a"):
        checkout = tmp_path / name
        if not checkout.exists():
            for f in files:
                (checkout / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / f, checkout / f)
        work = tmp_path / "work"  # the same absolute data paths for both: only the checkout differs
        res = subprocess.run(
            [sys.executable, "-m", "flows.data", "--step", "prepare", *small_overrides(work)],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, res.stderr[-2000:]
        outputs.setdefault(name, []).append(res.stderr)
    a_first, a_again = outputs["a"]
    assert "taken from the cache" not in a_first and "taken from the cache" in a_again  # its own cache works
    assert "taken from the cache" not in outputs["b"][0]  # b ran the stage itself, with a's result on disk
    assert all(any((tmp_path / name / ".prefect-results").iterdir()) for name in ("a", "b"))
