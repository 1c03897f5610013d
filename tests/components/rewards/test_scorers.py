"""Math, countdown and registry behaviour: hand-written cases, tricky ones included."""

from __future__ import annotations

import json
import textwrap

import pytest

from components.errors import ConfigError, RewardError
from components.rewards import countdown, math_eq
from components.rewards.custom import check_custom_reward
from components.rewards.registry import score_with_config, scorer_for, scorers_for
from components.validate import load_checked


@pytest.mark.parametrize(
    "text,truth,expected",
    [
        ("so \\boxed{\\dfrac{1}{2}}", "0.5", 1.0),  # dfrac vs decimal
        ("\\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
        ("\\boxed{-7}", "-7", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),  # thousands separator
        ("\\boxed{\\sqrt{4}}", "2", 1.0),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),  # symbolic equivalence
        ("\\boxed{0.51}", "0.5", 0.0),
        ("the answer is 0.5", "0.5", 0.0),  # no box, no reward
        ("\\boxed{\\frac{1}{2}", "0.5", 0.0),  # cut off before the box closed
    ],
)
def test_math(text, truth, expected):
    assert math_eq.score(text, truth) == expected


COUNTDOWN = json.dumps({"target": 24, "numbers": [3, 8, 1, 1]})


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<answer>3 * 8 * 1 * 1</answer>", 1.0),
        ("<answer>(8 - 1 - 1) * 3 + 6 - 6</answer>", 0.1),  # 6 is not given
        ("<answer>3 * 8 * 1</answer>", 0.1),  # a 1 is missing
        ("<answer>3 * 8 * 1 * 1 * 1</answer>", 0.1),  # 1 reused
        ("<answer>3 * 8 + 1 - 1</answer>", 1.0),
        ("<answer>8 / (1 - 1) + 3</answer>", 0.1),  # division by zero
        ("<answer>__import__('os').system('id')</answer>", 0.1),  # never evaluated
        ("<answer>3 ** 8</answer>", 0.1),  # no powers
        ("think... 3*8*1*1 = 24", 1.0),  # no tags: the last line with '='
        ("no equation", 0.0),
    ],
)
def test_countdown(text, expected):
    assert countdown.score(text, COUNTDOWN) == expected


def test_countdown_exact_fractions():
    truth = {"target": 2, "numbers": [1, 3, 6]}
    assert countdown.score("<answer>(1 + 3) / 6 * 3</answer>", {**truth, "numbers": [1, 3, 6, 3]}) == 1.0
    assert countdown.score("<answer>6 / 3 * 1</answer>", truth) == 1.0


def test_sources_override_and_default(tmp_path):
    cfg = load_checked(None, ['reward_model.sources={"arith": "math"}', "reward_model.default_scorer=gsm8k"])
    assert scorer_for("arith", cfg)("\\boxed{5}", "5", {}) == 1.0  # math, not gsm8k
    assert scorer_for("somewhere/else", cfg)("#### 5", "5", {}) == 1.0  # the default
    with pytest.raises(ConfigError, match="reward_model.sources"):
        scorer_for("somewhere/else", load_checked(None))
    with pytest.raises(ConfigError, match="reward_model.default_scorer='nope'"):
        load_checked(None, ["reward_model.default_scorer=nope"])


def test_sub_scores_are_returned_per_row():
    from components.rewards.registry import REWARDS

    REWARDS["test/subs"] = lambda cfg: lambda text, truth, extra: {"score": 1.0, "length": float(len(text))}
    try:
        scores, valid, subs = score_with_config(
            ["ab", "abc"], ["", ""], ["test/subs"] * 2, [{}, {}], load_checked(None)
        )
    finally:
        del REWARDS["test/subs"]
    assert scores == [1.0, 1.0] and valid == [True, True] and subs == {"length": [2.0, 3.0]}


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_custom_reward_function_loaded_by_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(
        tmp_path / "rewards/mine.py",
        """\
        def compute_score(response_text, ground_truth, extra_info):
            return {"score": float(ground_truth in response_text), "length": len(response_text)}

        def broken(response_text, ground_truth, extra_info):
            return 1 / 0
        """,
    )
    cfg = load_checked(None, ["custom_reward_function.path=rewards/mine.py"])
    scores, _, subs = score_with_config(["x 42", "x"], ["42", "42"], ["anything", "arith"], [{}, {}], cfg)
    assert scores == [1.0, 0.0] and subs == {"length": [4.0, 1.0]}
    broken = load_checked(
        None, ["custom_reward_function.path=rewards/mine.py", "custom_reward_function.name=broken"]
    )
    with pytest.raises(RewardError, match=r"mine.py:5: ZeroDivisionError"):
        score_with_config(["x"], ["1"], ["arith"], [{}], broken)


def test_custom_reward_function_errors_name_file_and_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "bad_syntax.py", "def f(:\n    pass\n")
    write(tmp_path / "bad_import.py", "x = 1\nimport not_a_module_anywhere\n")
    write(tmp_path / "ok.py", "def other(a, b, c):\n    return 0.0\n")
    outside = write(
        tmp_path.parent / f"{tmp_path.name}_outside.py", "def compute_score(a, b, c):\n    return 1\n"
    )
    cases = [
        ("bad_syntax.py", "compute_score", r"bad_syntax.py:1: SyntaxError"),
        ("bad_import.py", "compute_score", r"bad_import.py:2: ModuleNotFoundError"),
        ("ok.py", "compute_score", r"custom_reward_function.name=compute_score.*it has: other"),
        ("missing.py", "compute_score", r"custom_reward_function.path=missing.py: no Python file"),
        (str(outside), "compute_score", r"outside the project"),
    ]
    for path, name, match in cases:
        cfg = load_checked(
            None, [f"custom_reward_function.path={path}", f"custom_reward_function.name={name}"]
        )
        with pytest.raises(ConfigError, match=match):
            scorer_for("arith", cfg)


def test_custom_reward_function_scores_in_a_ray_worker(tmp_path, monkeypatch, ray_local):
    """Shipped by value: the worker process cannot import the user's file by name."""
    from components.settings import RewardSettings
    from components.training.ray_workers import start_reward_group

    monkeypatch.chdir(tmp_path)
    write(tmp_path / "mine.py", "def compute_score(text, truth, extra):\n    return float(text == truth)\n")
    cfg = load_checked(None, ["custom_reward_function.path=mine.py"])
    rewards = start_reward_group(RewardSettings(overlong=(0, 0, 0.0)))
    scores, valid, _ = rewards.score(
        ["1", "2"], ["1", "1"], ["arith"] * 2, [{}, {}], scorers_for(["arith"], cfg)
    )
    rewards.stop()
    assert scores == [1.0, 0.0] and valid == [True, True]


IMPORT_SIDE_EFFECTS = {
    "exits.py": ("import sys\nsys.exit(0)\n", r"it calls sys.exit\(0\) at import \(.*exits.py:2\)"),
    "hard_exit.py": ("import os\nos._exit(0)\n", r"importing it ended the process \(exit code 0\)"),
    "kills.py": (
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
        r"ended the process \(exit code -9\)",
    ),
    "thread.py": (
        "import threading, time\nthreading.Thread(target=time.sleep, args=(1e9,), name='keeper').start()\n",
        r"it starts a thread at import \(keeper\)",
    ),
}
SCORE = "\ndef compute_score(text, truth, extra):\n    return 1.0\n"


@pytest.mark.parametrize("name", sorted(IMPORT_SIDE_EFFECTS))
def test_a_reward_module_that_exits_or_holds_the_process_at_import_is_one_line(tmp_path, monkeypatch, name):
    """Checked in a process of its own before anything starts: the run's process neither ends (exit code 0
    having trained nothing) nor is held after training by a thread the module started."""
    from flows._args import check_config

    monkeypatch.chdir(tmp_path)
    source, said = IMPORT_SIDE_EFFECTS[name]
    write(tmp_path / name, source + SCORE)
    with pytest.raises(RewardError, match=said):
        check_custom_reward(load_checked(None, [f"custom_reward_function.path={name}"]))
    assert check_config(None, [f"custom_reward_function.path={name}"]) == 2  # the CLI: exit 2, one line


def test_a_reward_module_that_hangs_at_import_is_refused_at_the_timeout(tmp_path, monkeypatch):
    import components.rewards.custom as custom

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(custom, "CHECK_TIMEOUT_S", 2.0)
    write(tmp_path / "hangs.py", "import time\ntime.sleep(1e9)\n" + SCORE)
    with pytest.raises(RewardError, match="importing it did not finish within 2 s"):
        check_custom_reward(load_checked(None, ["custom_reward_function.path=hangs.py"]))


def test_the_scoring_process_imports_the_module_guarded_too():
    """Where the scorer is imported for use (the RewardScorer actor, the evaluation), an exit or a thread at
    import is a RewardError naming the file, not the end of that process."""
    from components.rewards.custom import CustomReward

    # the thread here ends on its own within a second: this test process must not be held by it either
    short_thread = (
        "import threading, time\nthreading.Thread(target=time.sleep, args=(0.5,), name='keeper').start()\n"
    )
    for source, said in (
        (IMPORT_SIDE_EFFECTS["exits.py"][0], r"it calls sys.exit\(0\) at import \(.*r.py:2\)"),
        (short_thread, r"it starts a thread at import \(keeper\)"),
    ):
        scorer = CustomReward("r.py", "/nowhere/r.py", "compute_score", source + SCORE)
        with pytest.raises(RewardError, match=said):
            scorer("x", "y", {})


@pytest.mark.parametrize("value", [1e308, -1e308, 1e7, float("inf"), float("nan")])
def test_rewards_too_large_to_train_on_are_invalid_not_nan_weights(value):
    """A finite reward of 1e308 still overflows its group's mean (inf) and every advantage (NaN): beyond
    ±MAX_ABS_REWARD it counts as invalid (reward.max_invalid_frac), as None, NaN and inf do."""
    from components.rewards.registry import MAX_ABS_REWARD, score_batch

    fixed = {"s": lambda text, truth, extra: value}
    scores, valid, _ = score_batch(["x"], ["1"], ["s"], [{}], fixed)
    assert (scores, valid) == ([0.0], [False])
    scores, valid, _ = score_batch(["x"], ["1"], ["s"], [{}], {"s": lambda *_: -MAX_ABS_REWARD})
    assert (scores, valid) == ([-MAX_ABS_REWARD], [True])
