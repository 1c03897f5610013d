"""Config: overrides, and errors that name the key and the fix before any work starts."""

import pytest

from components.config import flatten, parse_overrides
from components.errors import ConfigError
from components.validate import load_checked


def test_default_config_file_loads():
    cfg = load_checked("configs/arith_grpo.yaml")
    assert cfg.algorithm.name == "grpo" and cfg.engine.type == "hf"


def test_overrides_are_typed_and_nested():
    assert parse_overrides(["algorithm.beta=0.1", "data.shuffle=false"]) == {
        "algorithm": {"beta": 0.1},
        "data": {"shuffle": False},
    }
    cfg = load_checked("configs/arith_grpo.yaml", ["algorithm.beta=0.1", "engine.n=4"])
    assert cfg.algorithm.beta == 0.1 and cfg.engine.n == 4


def test_unknown_key_names_key_and_suggestion():
    with pytest.raises(ConfigError, match=r"algorithm\.betta: unknown key\. Did you mean `algorithm\.beta`"):
        load_checked("configs/arith_grpo.yaml", ["algorithm.betta=0.1"])


def test_unknown_section():
    with pytest.raises(ConfigError, match=r"trainr: unknown key.*Did you mean `trainer`"):
        load_checked(None, ["trainr.seed=1"])


def test_wrong_type_names_key_and_help():
    with pytest.raises(
        ConfigError, match=r"engine\.n: .*integer.*got 'many'.*completions sampled per prompt"
    ):
        load_checked(None, ["engine.n=many"])


def test_impossible_combination_gives_the_fix():
    with pytest.raises(ConfigError, match=r"engine\.n=1: grpo compares completions.*engine\.n >= 2"):
        load_checked(None, ["engine.n=1"])
    with pytest.raises(ConfigError, match=r"actor\.ppo_mini_batch_size=7 must divide"):
        load_checked(None, ["actor.ppo_mini_batch_size=7"])


def test_engine_not_installed_says_what_to_install():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ConfigError, match=r"engine\.type=vllm: package `vllm` is not installed.*pip install"):
        load_checked(None, ["engine.type=vllm"])


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ConfigError, match=r"algorithm\.name=grpoo: unknown preset\. Valid names: .*grpo"):
        load_checked(None, ["algorithm.name=grpoo"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_checked("configs/nope.yaml")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="is not key=value"):
        parse_overrides(["algorithm.beta"])


def test_flatten_has_dotted_keys():
    flat = flatten(load_checked(None))
    assert flat["actor.optimizer.lr"] == 1e-4 or "actor.optimizer.lr" in flat
    assert all("." in k for k in flat)


def test_beta_is_trls_name_for_kl_loss_coef_and_the_later_one_wins(tmp_path):
    cfg = load_checked("configs/arith_grpo.yaml", ["algorithm.beta=0.04"])  # the file sets kl_loss_coef: 0.0
    assert cfg.algorithm.kl_loss_coef == 0.04 and cfg.algorithm.beta == 0.04
    f = tmp_path / "c.yaml"
    f.write_text("algorithm:\n  beta: 0.1\n")
    assert load_checked(f, ["algorithm.kl_loss_coef=0.2"]).algorithm.kl_loss_coef == 0.2


def test_presets_fill_unset_knobs_and_keys_override_them():
    from components.algorithms.presets import resolve

    dapo = resolve(load_checked(None, ["algorithm.name=dapo"]).algorithm)
    assert (dapo.clip_ratio_high, dapo.dynamic_sampling, dapo.overlong_buffer_frac) == (0.28, True, 0.2)
    own = resolve(
        load_checked(
            None, ["algorithm.name=dapo", "algorithm.dynamic_sampling=false", "algorithm.clip_ratio_high=0.3"]
        ).algorithm
    )
    assert (own.clip_ratio_high, own.dynamic_sampling) == (0.3, False)
    ppo = resolve(load_checked(None, ["algorithm.name=ppo"]).algorithm)
    assert ppo.adv_estimator == "gae" and ppo.needs_critic and not ppo.needs_reference
    remax = resolve(load_checked(None, ["algorithm.name=remax"]).algorithm)
    assert remax.needs_baseline and not remax.grouped
    kl = resolve(load_checked(None, ["algorithm.kl_loss_coef=0.1"]).algorithm)
    assert kl.use_kl_loss and kl.needs_reference
    off = resolve(load_checked(None, ["algorithm.kl_loss_coef=0.1", "algorithm.use_kl_loss=false"]).algorithm)
    assert not off.use_kl_loss and not off.needs_reference
    in_reward = resolve(load_checked(None, ["algorithm.use_kl_in_reward=true"]).algorithm)
    assert in_reward.needs_reference and not in_reward.use_kl_loss


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["algorithm.name=dapo", "engine.n=1"], r"engine\.n=1: dynamic sampling|engine\.n=1: grpo"),
        (["algorithm.name=grpoo"], r"algorithm\.name=grpoo: unknown preset\. Valid names: .*dapo.*ppo"),
        (["algorithm.kl_penalty=k9"], r"algorithm\.kl_penalty=k9: unknown KL estimator"),
        (
            ["algorithm.adv_estimator=gea"],
            r"algorithm\.adv_estimator=gea: unknown advantage estimator\. Valid names",
        ),
    ],
)
def test_impossible_algorithm_combinations_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_checked("configs/arith_grpo.yaml", overrides)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["trainer.num_workers=2"],
            r"trainer\.backend=local runs one policy worker .* trainer\.num_workers=2",
        ),
        (
            ["engine.num_engines=2", "trainer.rollout_placement=separate"],
            r"trainer\.backend=local runs one rollout engine .* engine\.num_engines=2",
        ),
        (["engine.health_check=true"], r"engine\.health_check=true restarts an engine actor .* has none"),
    ],
)
def test_what_workers_in_this_process_cannot_do_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_checked("configs/arith_grpo.yaml", ["trainer.backend=local", *overrides])
    load_checked("configs/arith_grpo.yaml", overrides)  # on Ray's actors, each is fine


@pytest.mark.parametrize(
    "path",
    [
        "configs/gsm8k_grpo_qwen2_7b.yaml",
        "configs/gsm8k_grpo_qwen2_5_0_5b.yaml",
        "configs/arith_tool_grpo.yaml",
    ],
)
def test_shipped_configs_are_valid(path):
    """The GPU recipes fail here only for the engine (no vLLM, no GPU); every other key is valid."""
    from components.rollout.completions import engine_problems

    cfg = load_checked(path, ["engine.type=hf"]) if "gsm8k" in path else load_checked(path)
    assert cfg.algorithm.name == "grpo"
    if "gsm8k" in path:
        assert cfg.algorithm.kl_loss_coef == 0.05 and cfg.actor.optimizer.weight_decay == 0.01
        problems = engine_problems("vllm")
        try:
            load_checked(path)
        except ConfigError as exc:
            assert problems and all(p in str(exc) for p in problems)


def laughs(levels: int, width: int = 9) -> str:
    """A "billion laughs" YAML: each level a list of `width` aliases to the one before (width**levels values)."""
    lines = ['l0: &l0 ["lol"]']
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [6, 9, 30])
def test_nested_aliases_are_refused_in_linear_time(tmp_path, levels):
    """A small file whose aliases stand for billions of values is refused at once, naming the line, instead
    of being walked value by value (81 s at 9 levels before)."""
    import time

    path = tmp_path / "laughs.yaml"
    path.write_text(laughs(levels) + "trainer:\n  iterations: 3\n")
    start = time.perf_counter()
    with pytest.raises(
        ConfigError, match=r"laughs.yaml: line \d+, column \d+: this value expands to more than"
    ):
        load_checked(path)
    assert time.perf_counter() - start < 1.0


def test_aliases_that_stay_small_still_work_and_overrides_are_bounded_too(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("actor:\n  optimizer: &o {lr: 0.001}\ncritic:\n  optimizer: *o\n")
    cfg = load_checked(path)
    assert cfg.actor.optimizer.lr == cfg.critic.optimizer.lr == 0.001
    levels = ["&l0 [lol]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    with pytest.raises(ConfigError, match="override `x`: line 1, column .*: this value expands to more than"):
        parse_overrides(["x=[" + ", ".join(levels) + "]"])
    assert parse_overrides(["y=[&a [1, 2], *a]"])["y"] == [[1, 2], [1, 2]]


@pytest.mark.parametrize(
    "override", ["actor.optimizer.lr=.inf", "actor.optimizer.lr=1e309", "algorithm.clip_epsilon=.nan"]
)
def test_every_number_is_finite(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}: Input should be a finite number"):
        load_checked("configs/arith_grpo.yaml", [override])


@pytest.mark.parametrize("greedy", ["engine.temperature=0", "engine.top_k=1"])
def test_greedy_sampling_with_a_group_estimator_is_refused(greedy):
    """n identical completions per prompt: every group advantage 0, nothing learned, for the whole run."""
    with pytest.raises(ConfigError, match=rf"{greedy} samples greedily: .* group advantages are all 0"):
        load_checked("configs/arith_grpo.yaml", [greedy])
    for preset in ("rloo", "dapo"):
        with pytest.raises(ConfigError, match="samples greedily"):
            load_checked("configs/arith_grpo.yaml", [greedy, f"algorithm.name={preset}"])
    # no groups: PPO's one completion per prompt against its critic
    assert load_checked("configs/arith_grpo.yaml", [greedy, "algorithm.name=ppo", "engine.n=1"])
