"""GSM8K scorer: hand-written cases, tricky ones included, and invalid scores counted."""

import math

import pytest

from components.errors import ConfigError, RewardError
from components.rewards import gsm8k
from components.rewards.registry import REWARDS, score_with_config
from components.validate import load_checked


@pytest.mark.parametrize(
    "text,truth,expected",
    [
        ("#### 42", "42", 1.0),
        ("#### 42.", "42", 0.0),  # strict keeps the trailing dot: "42." != "42"
        ("#### 1,234", "1234", 1.0),  # commas removed
        ("#### -7", "-7", 1.0),  # negative numbers
        ("#### 41", "42", 0.0),  # extracted but wrong -> format_score (0)
        ("42", "42", 0.0),  # nothing extracted in strict mode
        ("#### 3\n#### 42", "42", 1.0),  # the last match counts
        ("#### 42" + "x" * 400, "42", 0.0),  # only the last 300 characters are read
    ],
)
def test_strict(text, truth, expected):
    assert gsm8k.score(text, truth) == expected


def test_format_score_and_flexible():
    assert gsm8k.score("#### 41", "42", format_score=0.1) == 0.1
    assert gsm8k.score("the answer is 42", "42", method="flexible") == 1.0
    assert gsm8k.extract_answer("no digits", method="flexible") is None


def test_score_batch_counts_invalid_and_names_failing_sample():
    cfg = load_checked(None)
    REWARDS["test/nan"] = lambda rm: lambda text, truth, extra: float("nan") if text == "bad" else 1.0
    REWARDS["test/raise"] = lambda rm: lambda text, truth, extra: 1 / 0
    try:
        scores, valid, _ = score_with_config(["ok", "bad"], ["1", "1"], ["test/nan"] * 2, [{}, {}], cfg)
        assert scores == [1.0, 0.0] and valid == [True, False] and all(math.isfinite(s) for s in scores)
        with pytest.raises(RewardError, match="sample 0"):
            score_with_config(["x"], ["1"], ["test/raise"], [{}], cfg)
        with pytest.raises(ConfigError, match="no reward scorer registered"):
            score_with_config(["x"], ["1"], ["unknown"], [{}], cfg)
    finally:
        REWARDS.pop("test/nan"), REWARDS.pop("test/raise")


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("#### 1,2", "12", 0.0),  # a comma that is no thousands separator: malformed, not 12
        ("#### 12,34", "1234", 0.0),
        ("#### 1,234", "1234", 1.0),  # a real thousands separator
        ("#### -1,234,567.5", "-1234567.5", 1.0),
        ("the answer is 1,2", "12", 0.0),
    ],
)
def test_malformed_answers_never_score_as_correct(response, truth, expected):
    from components.rewards.gsm8k import score

    method = "flexible" if not response.startswith("####") else "strict"
    assert score(response, truth, method=method) == expected
