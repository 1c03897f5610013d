"""Config: overrides, and errors that name the key and the fix before any work starts."""

import pytest

from components.config import flatten, load_config, parse_overrides
from components.errors import ConfigError


def test_default_config_file_loads():
    cfg = load_config("configs/arith_grpo.yaml")
    assert cfg.algorithm.name == "grpo" and cfg.engine.type == "hf"


def test_overrides_are_typed_and_nested():
    assert parse_overrides(["algorithm.beta=0.1", "data.shuffle=false"]) == {
        "algorithm": {"beta": 0.1}, "data": {"shuffle": False}}
    cfg = load_config("configs/arith_grpo.yaml", ["algorithm.beta=0.1", "engine.n=4"])
    assert cfg.algorithm.beta == 0.1 and cfg.engine.n == 4


def test_unknown_key_names_key_and_suggestion():
    with pytest.raises(ConfigError, match=r"algorithm\.betta: unknown key\. Did you mean `algorithm\.beta`"):
        load_config("configs/arith_grpo.yaml", ["algorithm.betta=0.1"])


def test_unknown_section():
    with pytest.raises(ConfigError, match=r"trainr: unknown key.*Did you mean `trainer`"):
        load_config(None, ["trainr.seed=1"])


def test_wrong_type_names_key_and_help():
    with pytest.raises(ConfigError, match=r"engine\.n: .*integer.*got 'many'.*completions sampled per prompt"):
        load_config(None, ["engine.n=many"])


def test_impossible_combination_gives_the_fix():
    with pytest.raises(ConfigError, match=r"engine\.n=1: grpo compares completions.*engine\.n >= 2"):
        load_config(None, ["engine.n=1"])
    with pytest.raises(ConfigError, match=r"actor\.ppo_mini_batch_size=7 must divide"):
        load_config(None, ["actor.ppo_mini_batch_size=7"])


def test_engine_not_installed_says_what_to_install():
    with pytest.raises(ConfigError, match=r"engine\.type=vllm: package `vllm` is not installed.*pip install"):
        load_config(None, ["engine.type=vllm"])


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ConfigError, match=r"algorithm\.name=grpoo: unknown preset\. Valid names: .*grpo"):
        load_config(None, ["algorithm.name=grpoo"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="is not key=value"):
        parse_overrides(["algorithm.beta"])


def test_flatten_has_dotted_keys():
    flat = flatten(load_config(None))
    assert flat["actor.optimizer.lr"] == 1e-4 or "actor.optimizer.lr" in flat
    assert all("." in k for k in flat)
