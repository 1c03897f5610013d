"""Advantage estimators: hand-computed cases, properties, and loop-vs-vectorized equivalence."""

import math

import pytest
import torch

from components.algorithms.advantages import ADVANTAGES, AdvantageParams, discounted_returns, gae, grpo, rloo

P = AdvantageParams()


def seq_rewards(scores, length=3):
    """(B, T) token rewards with each score on the last token, and a full mask."""
    r = torch.zeros(len(scores), length)
    r[:, -1] = torch.tensor(scores, dtype=torch.float32)
    return r, torch.ones(len(scores), length)


def test_grpo_hand_computed():
    # group 0: scores 1, 0, 0, 1 -> mean 0.5, unbiased std = sqrt(1/3) = 0.57735
    # group 1: scores 1, 0 -> mean 0.5, std = sqrt(0.5) = 0.70711
    # A = +-0.5 / 0.57735 = +-0.866025 and +-0.5 / 0.70711 = +-0.707107
    r, m = seq_rewards([1, 0, 0, 1, 1, 0])
    adv, ret = grpo(r, m, torch.tensor([0, 0, 0, 0, 1, 1]), None, P)
    expected = torch.tensor([0.866024, -0.866024, -0.866024, 0.866024, 0.707106, -0.707106])
    torch.testing.assert_close(adv[:, 0], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(adv, ret)


def test_dr_grpo_has_no_std_division():
    r, m = seq_rewards([3.0, 1.0, 2.0])
    adv, _ = grpo(r, m, torch.tensor([0, 0, 0]), None, AdvantageParams(norm_adv_by_std=False))
    torch.testing.assert_close(adv[:, 1], torch.tensor([1.0, -1.0, 0.0]))


def test_rloo_hand_computed():
    # n = 3, scores 3, 0, 0: leave-one-out baselines 0, 1.5, 1.5 -> 3, -1.5, -1.5
    r, m = seq_rewards([3.0, 0.0, 0.0])
    adv, _ = rloo(r, m, torch.tensor([7, 7, 7]), None, P)
    torch.testing.assert_close(adv[:, 0], torch.tensor([3.0, -1.5, -1.5]))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_all_equal_rewards_give_zero_and_no_nan(name):
    r, m = seq_rewards([1.0, 1.0, 1.0, 1.0])
    adv, _ = ADVANTAGES.get(name)(r, m, torch.tensor([0, 0, 1, 1]), None, P)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv, torch.zeros_like(adv))


def test_group_of_one_keeps_raw_score():
    r, m = seq_rewards([0.7])
    adv, _ = grpo(r, m, torch.tensor([0]), None, P)
    assert math.isclose(float(adv[0, 0]), 0.7 / (1 + 1e-6), rel_tol=1e-6)


def test_shift_invariance_grpo():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(8, generator=g)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    a1, _ = grpo(*seq_rewards(scores.tolist()), ids, None, P)
    a2, _ = grpo(*seq_rewards((scores + 5.0).tolist()), ids, None, P)
    torch.testing.assert_close(a1, a2, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus"])
def test_masked_positions_never_change_the_result(name):
    g = torch.Generator().manual_seed(1)
    r = torch.rand(6, 5, generator=g)
    m = torch.ones(6, 5)
    m[:, 3:] = 0
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    fn = ADVANTAGES.get(name)
    a1, _ = fn(r * m, m, ids, None, P)
    garbage = r.clone()
    garbage[:, 3:] = 1e6
    a2, _ = fn(garbage * m, m, ids, None, P)
    torch.testing.assert_close(a1, a2)
    assert (a1[:, 3:] == 0).all()


def _grpo_loop(scores, ids, eps=1e-6):
    out = []
    for s, i in zip(scores, ids):
        group = [x for x, j in zip(scores, ids) if j == i]
        if len(group) == 1:
            out.append(s / (1 + eps))
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        out.append((s - mean) / (std + eps))
    return out


def test_grpo_loop_equals_vectorized():
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(20, generator=g).tolist()
    ids = torch.randint(0, 6, (20,), generator=g).tolist()
    adv, _ = grpo(*seq_rewards(scores), torch.tensor(ids), None, P)
    torch.testing.assert_close(adv[:, 0], torch.tensor(_grpo_loop(scores, ids)), atol=1e-5, rtol=1e-5)


def test_discounted_returns_hand_computed():
    r = torch.tensor([[1.0, 0.0, 2.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # gamma 0.5: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5; masked position 0
    torch.testing.assert_close(discounted_returns(r * m, m, 0.5), torch.tensor([[1.5, 1.0, 2.0, 0.0]]))


def test_gae_loop_equals_reference():
    g = torch.Generator().manual_seed(3)
    r, v = torch.rand(3, 6, generator=g), torch.rand(3, 6, generator=g)
    m = torch.ones(3, 6)
    p = AdvantageParams(gamma=0.9, lam=0.8)
    _, ret = gae(r, m, torch.arange(3), v, p)
    expected = torch.zeros(3, 6)
    for b in range(3):
        a = 0.0
        for t in reversed(range(6)):
            nv = v[b, t + 1] if t < 5 else 0.0
            a = r[b, t] + 0.9 * nv - v[b, t] + 0.9 * 0.8 * a
            expected[b, t] = a + v[b, t]
    torch.testing.assert_close(ret, expected, atol=1e-5, rtol=1e-5)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(KeyError, match="Valid names: .*grpo"):
        ADVANTAGES.get("grpoo")


def test_double_registration_raises():
    with pytest.raises(ValueError, match="registered twice"):
        ADVANTAGES.register("grpo")(lambda *a: a)


def test_opo_length_weighted_baseline():
    # lengths 1 and 3, scores 1 and 0: baseline = (1*1 + 3*0) / 4 = 0.25 -> A = 0.75, -0.25
    r = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv, _ = ADVANTAGES.get("opo")(r, m, torch.tensor([0, 0]), None, P)
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.0, 0.0], [-0.25, -0.25, -0.25]]))


def test_grpo_passk_only_the_best_gets_credit():
    # scores 1, 0.5, 0: gap 0.5, unbiased std 0.5 -> best gets 0.5 / 0.5 = 1, the others 0
    r, m = seq_rewards([0.5, 1.0, 0.0])
    adv, _ = ADVANTAGES.get("grpo_passk")(r, m, torch.tensor([0, 0, 0]), None, P)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 1.0 / (1 + 2e-6), 0.0]), atol=1e-5, rtol=0)
    alone, _ = ADVANTAGES.get("grpo_passk")(*seq_rewards([1.0]), torch.tensor([0]), None, P)
    assert (alone == 0).all()  # a group of one has nothing to beat


# ---- every estimator: the properties, and the newer ones by hand --------------------------------------------

GROUPED = [n for n in ADVANTAGES.names() if ADVANTAGES.info(n).get("grouped")]


def _values_for(name, r):
    """What an estimator takes as `values`: critic values (gae), a greedy baseline (remax), else None."""
    info = ADVANTAGES.info(name)
    if info.get("needs_values") or info.get("needs_baseline"):
        return torch.linspace(0.1, 0.9, r.numel()).reshape(r.shape)
    return None


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_every_estimator_ignores_masked_positions(name):
    g = torch.Generator().manual_seed(4)
    r = torch.rand(6, 5, generator=g)
    m = torch.ones(6, 5)
    m[:, 3:] = 0
    m[0, 1:] = 0
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    fn = ADVANTAGES.get(name)
    v = _values_for(name, r)
    a1, ret1 = fn(r * m, m, ids, None if v is None else v * m, P)
    garbage, gv = r.clone(), None if v is None else v.clone()
    garbage[m == 0] = 1e6
    if gv is not None:
        gv[m == 0] = -1e6
    a2, ret2 = fn(garbage * m, m, ids, gv, P)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(ret1 * m, ret2 * m)
    assert (a1[m == 0] == 0).all() and torch.isfinite(a1).all()


@pytest.mark.parametrize("name", GROUPED)
def test_grouped_estimators_all_equal_rewards_give_zero(name):
    r, m = seq_rewards([0.5] * 6)
    adv, _ = ADVANTAGES.get(name)(r, m, torch.tensor([0, 0, 0, 1, 1, 1]), None, P)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv, torch.zeros_like(adv))


@pytest.mark.parametrize("name", GROUPED)
def test_grouped_estimators_are_shift_invariant_per_group(name):
    g = torch.Generator().manual_seed(5)
    scores = torch.rand(8, generator=g)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    shift = torch.tensor([3.0] * 4 + [-7.0] * 4)  # a different constant for each group
    fn = ADVANTAGES.get(name)
    a1, _ = fn(*seq_rewards(scores.tolist()), ids, None, P)
    a2, _ = fn(*seq_rewards((scores + shift).tolist()), ids, None, P)
    torch.testing.assert_close(a1, a2, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", [n for n in GROUPED if n != "grpo_passk"])
def test_grouped_estimators_group_of_one_is_finite(name):
    adv, _ = ADVANTAGES.get(name)(*seq_rewards([0.3, 1.0, 0.0]), torch.tensor([0, 1, 1]), None, P)
    assert torch.isfinite(adv).all()


def test_rloo_loop_equals_vectorized():
    g = torch.Generator().manual_seed(6)
    scores = torch.rand(15, generator=g).tolist()
    ids = torch.randint(0, 4, (15,), generator=g).tolist()
    expected = []
    for i, (s, gid) in enumerate(zip(scores, ids)):
        others = [x for j, (x, h) in enumerate(zip(scores, ids)) if h == gid and j != i]
        expected.append(s - sum(others) / len(others) if others else s)
    adv, _ = rloo(*seq_rewards(scores), torch.tensor(ids), None, P)
    torch.testing.assert_close(adv[:, 0], torch.tensor(expected), atol=1e-5, rtol=0)


def test_opo_loop_equals_vectorized():
    g = torch.Generator().manual_seed(7)
    B, T = 12, 6
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    m = (torch.arange(T)[None] < lengths[:, None]).float()
    scores = torch.rand(B, generator=g)
    r = torch.zeros(B, T)
    r[torch.arange(B), lengths - 1] = scores
    ids = torch.randint(0, 3, (B,), generator=g)
    expected = []
    for i in range(B):
        grp = [j for j in range(B) if ids[j] == ids[i]]
        base = sum(float(lengths[j] * scores[j]) for j in grp) / sum(int(lengths[j]) for j in grp)
        expected.append(float(scores[i]) - base)
    adv, _ = ADVANTAGES.get("opo")(r, m, ids, None, P)
    torch.testing.assert_close(adv, torch.tensor(expected)[:, None] * m, atol=1e-5, rtol=0)


def test_reinforce_plus_plus_baseline_hand_computed():
    # scores 1, 0 | 1, 1 -> r - group mean = 0.5, -0.5, 0, 0 over 2 tokens each: 8 entries, mean 0,
    # unbiased var = (4 * 0.25) / 7 -> whitened 0.5 / sqrt(1/7) = 1.3229
    r, m = seq_rewards([1.0, 0.0, 1.0, 1.0], length=2)
    adv, _ = ADVANTAGES.get("reinforce_plus_plus_baseline")(r, m, torch.tensor([0, 0, 1, 1]), None, P)
    z = 0.5 / math.sqrt(1 / 7 + 1e-8)
    torch.testing.assert_close(
        adv, torch.tensor([[z, z], [-z, -z], [0.0, 0.0], [0.0, 0.0]]), atol=1e-4, rtol=0
    )


def test_remax_hand_computed():
    # token rewards 0, 0, 1 (score on the last token), greedy baseline 0.25: reward-to-go 1, 1, 1 -> A = 0.75
    # a second response of length 2 with score 0 against baseline 0.25 -> -0.25, -0.25, masked 0
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    base = torch.tensor([0.25, 0.25])[:, None] * m
    adv, ret = ADVANTAGES.get("remax")(r, m, torch.tensor([0, 0]), base, P)
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.75], [-0.25, -0.25, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="greedy"):
        ADVANTAGES.get("remax")(r, m, torch.tensor([0, 0]), None, P)


def test_gae_hand_computed_with_lambda():
    # one sequence of 2 tokens, r = (0, 1), V = (0.5, 0.8), gamma 1, lambda 0.5:
    # delta_1 = 1 - 0.8 = 0.2; A_1 = 0.2; delta_0 = 0 + 0.8 - 0.5 = 0.3; A_0 = 0.3 + 0.5 * 0.2 = 0.4
    # returns = A + V = (0.9, 1.0)
    r = torch.tensor([[0.0, 1.0]])
    v = torch.tensor([[0.5, 0.8]])
    _, ret = gae(r, torch.ones(1, 2), torch.tensor([0]), v, AdvantageParams(gamma=1.0, lam=0.5))
    torch.testing.assert_close(ret, torch.tensor([[0.9, 1.0]]))


def test_dr_grpo_estimator_never_divides_by_std():
    r, m = seq_rewards([3.0, 1.0, 2.0])
    adv, _ = ADVANTAGES.get("dr_grpo")(
        r, m, torch.tensor([0, 0, 0]), None, AdvantageParams(norm_adv_by_std=True)
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1.0, 0.0]))
