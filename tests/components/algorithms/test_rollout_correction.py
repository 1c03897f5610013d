"""Rollout correction (algorithm.rollout_correction): each mode's weights against a hand-computed case, the
advantages they give, and the config's checks."""

from __future__ import annotations

import math

import pytest
import torch

from components.algorithms.rollout_correction import ROLLOUT_CORRECTIONS, correct_advantages
from components.errors import ConfigError
from components.validate import load_checked

# two sequences of 3 tokens, the second one token shorter; log w = old - rollout
OLD = torch.tensor([[0.0, math.log(3.0), -1.0], [math.log(0.25), 0.0, 5.0]])
ROLLOUT = torch.tensor([[0.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# token weights w: [[1, 3, 1], [0.25, 1, (masked)]]; sequence weights W: 3 and 0.25


@pytest.mark.parametrize(
    "mode, weights, changed",
    [
        ("tis", [[1.0, 2.0, 1.0], [0.25, 1.0, 0.0]], [[0, 1, 0], [0, 0, 0]]),
        ("mis", [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], [[0, 1, 0], [1, 0, 0]]),
        ("seq_tis", [[2.0, 2.0, 2.0], [0.25, 0.25, 0.0]], [[1, 1, 1], [0, 0, 0]]),
        ("seq_mis", [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[1, 1, 1], [1, 1, 0]]),
    ],
)
def test_each_mode_against_a_hand_computed_case(mode, weights, changed):
    w, c = ROLLOUT_CORRECTIONS.get(mode)(OLD, ROLLOUT, MASK, 2.0)
    assert torch.allclose(w, torch.tensor(weights), atol=1e-6), w
    assert c.int().tolist() == changed
    assert not w.requires_grad


def test_the_advantages_are_weighted_and_the_metrics_describe_the_weights():
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    out, m = correct_advantages(adv, OLD, ROLLOUT, MASK, "tis", 2.0)
    assert torch.allclose(out, torch.tensor([[1.0, 2.0, 1.0], [-0.5, -2.0, 0.0]]))
    assert m["rollout_corr/weight_mean"] == pytest.approx((1 + 3 + 1 + 0.25 + 1) / 5)
    assert m["rollout_corr/weight_max"] == pytest.approx(3.0)
    assert m["rollout_corr/changed_frac"] == pytest.approx(1 / 5)
    # geometric mean weight per sequence: 3^(1/3) and 0.25^(1/2)
    assert m["rollout_corr/seq_weight_mean"] == pytest.approx((3 ** (1 / 3) + 0.5) / 2)


def test_equal_log_probs_leave_the_advantages_unchanged():
    adv = torch.randn(2, 3)
    for mode in ROLLOUT_CORRECTIONS.names():
        out, m = correct_advantages(adv, OLD, OLD, MASK, mode, 2.0)
        assert torch.equal(out, adv * MASK) and m["rollout_corr/changed_frac"] == 0.0


def test_an_unknown_mode_names_the_key_and_the_valid_ones():
    with pytest.raises(ConfigError, match=r"algorithm\.rollout_correction\.mode=tiss: unknown.*seq_mis"):
        load_checked("configs/arith_grpo.yaml", ["algorithm.rollout_correction.mode=tiss"])
    with pytest.raises(ConfigError, match=r"algorithm\.rollout_correction\.cap"):
        load_checked("configs/arith_grpo.yaml", ["algorithm.rollout_correction.cap=0.5"])


def test_the_correction_makes_the_trainer_compute_old_log_probs():
    from components.plan import make_plan

    plan = make_plan(load_checked("configs/arith_grpo.yaml", ["algorithm.rollout_correction.mode=seq_tis"]))
    assert plan.policy.need_old and plan.algorithm.rollout_correction == "seq_tis"
