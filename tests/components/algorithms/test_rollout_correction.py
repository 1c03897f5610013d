"""Rollout correction (algorithm.rollout_correction): each mode's weights against a hand-computed case, the
advantages they give, and the config's checks."""

from __future__ import annotations

import math

import pytest
import torch

from components.algorithms.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    CorrectionParams,
    correct_advantages,
)
from components.errors import ConfigError
from components.validate import load_checked

# two sequences of 3 tokens, the second one token shorter; log w = old - rollout
OLD = torch.tensor([[0.0, math.log(3.0), -1.0], [math.log(0.25), 0.0, 5.0]])
ROLLOUT = torch.tensor([[0.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# token weights w: [[1, 3, 1], [0.25, 1, (masked)]]; sequence weights W: 3 and 0.25
CAP2 = CorrectionParams(cap=2.0)
ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])


@pytest.mark.parametrize(
    "mode, weights, changed",
    [
        ("tis", [[1.0, 2.0, 1.0], [0.25, 1.0, 0.0]], [[0, 1, 0], [0, 0, 0]]),
        ("mis", [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], [[0, 1, 0], [1, 0, 0]]),
        ("seq_tis", [[2.0, 2.0, 2.0], [0.25, 0.25, 0.0]], [[1, 1, 1], [0, 0, 0]]),
        ("seq_mis", [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[1, 1, 1], [1, 1, 0]]),
        # geometric means 3^(1/3) = 1.442 and 0.25^(1/2) = 0.5: only the first lies in [0.999, 1.5]
        ("geo_mis", [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], [[0, 0, 0], [1, 1, 0]]),
        # the band [0.5, 5]: 0.25 falls out, 3 stays in
        ("icepop", [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]], [[0, 0, 0], [1, 0, 0]]),
        # divergence mean log(p_rollout / p_old): -ln3/3 (first, positive advantage anyway) and
        # ln4/2 = 0.69 > 0.5 for the second, whose advantage is negative: masked
        ("offpolicy_mask", [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], [[0, 0, 0], [1, 1, 0]]),
    ],
)
def test_each_mode_against_a_hand_computed_case(mode, weights, changed):
    if mode in ("geo_mis", "offpolicy_mask"):
        params = CorrectionParams(cap=2.0, geo_low=0.999, geo_high=1.5, offpolicy_threshold=0.5)
        w, c = ROLLOUT_CORRECTIONS.get(mode)(OLD, ROLLOUT, MASK, ADV, params)
        assert torch.allclose(w, torch.tensor(weights), atol=1e-6), w
        assert c.int().tolist() == changed
        return
    w, c = ROLLOUT_CORRECTIONS.get(mode)(OLD, ROLLOUT, MASK, ADV, CAP2)
    assert torch.allclose(w, torch.tensor(weights), atol=1e-6), w
    assert c.int().tolist() == changed
    assert not w.requires_grad


def test_the_advantages_are_weighted_and_the_metrics_describe_the_weights():
    out, m = correct_advantages(ADV, OLD, ROLLOUT, MASK, "tis", CAP2)
    assert torch.allclose(out, torch.tensor([[1.0, 2.0, 1.0], [-0.5, -2.0, 0.0]]))
    assert m["rollout_corr/weight_mean"] == pytest.approx((1 + 3 + 1 + 0.25 + 1) / 5)
    assert m["rollout_corr/weight_max"] == pytest.approx(3.0)
    assert m["rollout_corr/changed_frac"] == pytest.approx(1 / 5)
    # geometric mean weight per sequence: 3^(1/3) and 0.25^(1/2)
    assert m["rollout_corr/seq_weight_mean"] == pytest.approx((3 ** (1 / 3) + 0.5) / 2)


def test_equal_log_probs_leave_the_advantages_unchanged():
    adv = torch.randn(2, 3)
    for mode in ROLLOUT_CORRECTIONS.names():
        out, m = correct_advantages(adv, OLD, OLD, MASK, mode, CAP2)
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


def test_the_off_policy_mask_keeps_a_positive_sequence_however_far_it_drifted():
    params = CorrectionParams(offpolicy_threshold=0.5)
    flipped = torch.tensor(
        [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]
    )  # the drifted sequence now scores above its group
    w, c = ROLLOUT_CORRECTIONS.get("offpolicy_mask")(OLD, ROLLOUT, MASK, flipped, params)
    assert torch.equal(w, MASK) and not c.any()
    # and a threshold above its divergence (ln 4 / 2 = 0.693) keeps the negative one too
    w, _ = ROLLOUT_CORRECTIONS.get("offpolicy_mask")(
        OLD, ROLLOUT, MASK, ADV, CorrectionParams(offpolicy_threshold=0.7)
    )
    assert torch.equal(w, MASK)


def test_modes_joined_by_plus_multiply_and_report_each_part():
    out, m = correct_advantages(ADV, OLD, ROLLOUT, MASK, "tis+icepop", CAP2)
    # tis: [[1, 2, 1], [0.25, 1, 0]]; icepop masks the 0.25 token
    assert torch.allclose(out, torch.tensor([[1.0, 2.0, 1.0], [0.0, -2.0, 0.0]]))
    assert m["rollout_corr/tis_frac"] == pytest.approx(1 / 5)
    assert m["rollout_corr/icepop_frac"] == pytest.approx(1 / 5)
    assert m["rollout_corr/changed_frac"] == pytest.approx(2 / 5)
    assert m["rollout_corr/seq_masked_frac"] == 0.0
    _, m = correct_advantages(ADV, OLD, ROLLOUT, MASK, "seq_mis", CAP2)
    assert m["rollout_corr/seq_masked_frac"] == 1.0


@pytest.mark.parametrize(
    "override, key",
    [
        (
            "algorithm.rollout_correction.band_low=6",
            r"band_low=6.0 is above algorithm\.rollout_correction\.band_high",
        ),
        ("algorithm.rollout_correction.geo_low=1.2", r"geo_low=1.2 is above"),
        (
            "algorithm.rollout_correction.mode=tis+icepopp",
            r"rollout_correction\.mode=icepopp: unknown.*offpolicy_mask",
        ),
    ],
)
def test_a_bad_band_or_part_names_its_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_checked("configs/arith_grpo.yaml", [override])
