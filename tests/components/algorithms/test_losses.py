"""Loss aggregation, KL estimators and the PPO clip loss: hand-computed cases and invariances."""

import math

import pytest
import torch

from components.algorithms.losses import AggParams, agg_loss, kl_penalty, vanilla_ppo
from components.settings import PolicyLossParams

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
AGG = AggParams(num_tokens=4, num_seqs=2, norm_const=3)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-sum", (6 + 4) / 2),  # 5
        ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),  # 3
        ("seq-mean-token-sum-norm", 10 / (2 * 3)),  # 1.6667
    ],
)
def test_agg_modes_hand_computed(mode, expected):
    assert math.isclose(float(agg_loss(LOSS, MASK, mode, AGG)), expected, rel_tol=1e-6)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_agg_parts_with_global_counts_sum_to_whole(mode):
    whole = agg_loss(LOSS, MASK, mode, AGG)
    parts = agg_loss(LOSS[:1], MASK[:1], mode, AGG) + agg_loss(LOSS[1:], MASK[1:], mode, AGG)
    torch.testing.assert_close(whole, parts)


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # log pi - log ref = 1
    assert math.isclose(float(kl_penalty(logp, ref, "k1")), 1.0)
    assert math.isclose(float(kl_penalty(logp, ref, "abs")), 1.0)
    assert math.isclose(float(kl_penalty(logp, ref, "mse")), 0.5)
    # k3: x = ref - logp = -1 -> e^-1 - (-1) - 1 = 0.367879
    assert math.isclose(float(kl_penalty(logp, ref, "low_var_kl")), math.exp(-1), rel_tol=1e-6)


def test_k3_is_zero_at_equal_policies_and_clamped():
    x = torch.tensor([-3.0, 0.5])
    torch.testing.assert_close(kl_penalty(x, x, "k3"), torch.zeros(2))
    assert float(kl_penalty(torch.tensor([0.0]), torch.tensor([-50.0]), "k3").max()) <= 10.0


def test_straight_through_kl_has_k3_value_and_k2_gradient():
    logp = torch.tensor([-1.0], requires_grad=True)
    ref = torch.tensor([-2.0])
    out = kl_penalty(logp, ref, "k3+")
    out.backward()
    assert math.isclose(float(out), math.exp(-1), rel_tol=1e-6)
    assert math.isclose(float(logp.grad), 1.0)  # d/dlogp of 0.5 (logp - ref)^2 = 1


def test_ppo_clip_hand_computed():
    # ratio e^{0.5} = 1.6487 with A = +1: clipped at 1.2 -> loss -1.2, clipfrac 1
    # ratio e^{-0.5} = 0.6065 with A = -1: clipped at 0.8 -> max(0.6065, 0.8) = 0.8, below dual clip 3 -> 0.8
    logp = torch.tensor([[0.5, -0.5]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    loss, m = vanilla_ppo(logp, old, adv, mask, PolicyLossParams(0.2, 0.2), AggParams(2, 1))
    assert math.isclose(float(loss), (-1.2 + 0.8) / 2, rel_tol=1e-6)
    assert float(m["actor/pg_clipfrac"]) == 1.0
    assert math.isclose(float(m["actor/ppo_kl"]), 0.0, abs_tol=1e-7)


def test_dual_clip_bounds_negative_advantage_loss():
    # ratio e^{2} = 7.39 with A = -1: clipped loss max(7.39, 1.2) = 7.39 -> dual clip min(7.39, 3) = 3
    loss, m = vanilla_ppo(
        torch.tensor([[2.0]]),
        torch.zeros(1, 1),
        torch.tensor([[-1.0]]),
        torch.ones(1, 1),
        PolicyLossParams(0.2, 0.2, 3.0),
        AggParams(1, 1),
    )
    assert math.isclose(float(loss), 3.0, rel_tol=1e-6)
    assert float(m["actor/pg_clipfrac_lower"]) == 1.0


def test_clip_higher_is_asymmetric():
    logp = torch.tensor([[math.log(1.25)]])
    loss_sym, _ = vanilla_ppo(
        logp,
        torch.zeros(1, 1),
        torch.ones(1, 1),
        torch.ones(1, 1),
        PolicyLossParams(0.2, 0.2),
        AggParams(1, 1),
    )
    loss_high, _ = vanilla_ppo(
        logp,
        torch.zeros(1, 1),
        torch.ones(1, 1),
        torch.ones(1, 1),
        PolicyLossParams(0.2, 0.28),
        AggParams(1, 1),
    )
    assert math.isclose(float(loss_sym), -1.2, rel_tol=1e-6)
    assert math.isclose(float(loss_high), -1.25, rel_tol=1e-6)


def test_masked_tokens_never_change_the_loss():
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(4, 5, generator=g) for _ in range(3))
    mask = torch.ones(4, 5)
    mask[:, 3:] = 0
    agg = AggParams(float(mask.sum()), 4)
    l1, _ = vanilla_ppo(logp, old, adv, mask, PolicyLossParams(), agg)
    logp2 = logp.clone()
    logp2[:, 3:] = 100.0
    l2, _ = vanilla_ppo(logp2, old, adv, mask, PolicyLossParams(), agg)
    torch.testing.assert_close(l1, l2)


def test_gspo_uses_the_sequence_ratio():
    from components.algorithms.losses import gspo

    # token log-ratios 0.2 and 0.0 -> sequence ratio e^{0.1} = 1.10517, inside clip 0.2: loss = -A s
    logp = torch.tensor([[0.2, 0.0]], requires_grad=True)
    loss, m = gspo(
        logp,
        torch.zeros(1, 2),
        torch.ones(1, 2),
        torch.ones(1, 2),
        PolicyLossParams(0.2, 0.2, agg_mode="seq-mean-token-mean"),
        AggParams(2, 1),
    )
    assert math.isclose(float(loss), -math.exp(0.1), rel_tol=1e-6)
    loss.backward()  # d/dlogp_t of -mean_t(s) = -s / 2 for each token
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -math.exp(0.1) / 2))
    clipped, _ = gspo(
        torch.tensor([[1.0, 1.0]]),
        torch.zeros(1, 2),
        torch.ones(1, 2),
        torch.ones(1, 2),
        PolicyLossParams(0.2, 0.2, agg_mode="seq-mean-token-mean"),
        AggParams(2, 1),
    )
    assert math.isclose(float(clipped), -1.2, rel_tol=1e-6)


def test_cispo_clips_the_weight_but_keeps_the_gradient():
    from components.algorithms.losses import cispo

    # ratio e^{0.5} = 1.6487 clipped to 1.2; L = -A * 1.2 * logp; dL/dlogp = -1.2 (not 0 as in PPO clip)
    logp = torch.tensor([[0.5]], requires_grad=True)
    loss, m = cispo(
        logp,
        torch.zeros(1, 1),
        torch.ones(1, 1),
        torch.ones(1, 1),
        PolicyLossParams(0.2, 0.2),
        AggParams(1, 1),
    )
    assert math.isclose(float(loss), -1.2 * 0.5, rel_tol=1e-6)
    loss.backward()
    assert math.isclose(float(logp.grad), -1.2, rel_tol=1e-6)
    assert float(m["actor/pg_clipfrac"]) == 1.0


def test_presets_resolve_and_unknown_lists_names():
    from components.algorithms.presets import PRESETS, resolve
    from components.config.schema import AlgorithmConfig

    for name in PRESETS:
        resolve(AlgorithmConfig(name=name))
    assert resolve(AlgorithmConfig(name="gspo")).policy_loss == "gspo"
    assert resolve(AlgorithmConfig(name="dr_grpo")).norm_adv_by_std is False
    assert resolve(AlgorithmConfig(name="grpo", policy_loss="cispo")).policy_loss == "cispo"
    with pytest.raises(KeyError, match="Valid names"):
        resolve(AlgorithmConfig(name="nope"))


def test_value_loss_hand_computed():
    from components.algorithms.losses import value_loss

    # token 1: v 1.0, old 0.0, R 2.0, clip 0.5 -> clipped v 0.5: max((1-2)^2, (0.5-2)^2) = 2.25, clipped wins
    # token 2: v 0.2, old 0.0, R 0.0 -> inside the clip: max(0.04, 0.04) = 0.04
    v = torch.tensor([[1.0, 0.2]])
    loss, m = value_loss(
        v, torch.zeros(1, 2), torch.tensor([[2.0, 0.0]]), torch.ones(1, 2), 0.5, "token-mean", AggParams(2, 1)
    )
    assert math.isclose(float(loss), 0.5 * (2.25 + 0.04) / 2, rel_tol=1e-6)
    assert float(m["critic/vf_clipfrac"]) == 0.5


def test_value_loss_ignores_masked_tokens():
    from components.algorithms.losses import value_loss

    g = torch.Generator().manual_seed(0)
    v, old, ret = (torch.randn(3, 4, generator=g) for _ in range(3))
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    agg = AggParams(float(mask.sum()), 3)
    a, _ = value_loss(v, old, ret, mask, 0.2, "token-mean", agg)
    v2 = v.clone()
    v2[mask == 0] = 1e3
    b, _ = value_loss(v2, old, ret, mask, 0.2, "token-mean", agg)
    torch.testing.assert_close(a, b)


def test_explained_variance_hand_computed():
    from components.algorithms.losses import explained_variance

    ret = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(ret, ret, mask) == 1.0
    assert math.isclose(explained_variance(torch.full((1, 4), 2.0), ret, mask), 0.0, abs_tol=1e-7)
    # residual (1, 2, 3) - (1, 1, 1) = (0, 1, 2): var 2/3 over var(R) 2/3 -> 0
    assert math.isclose(explained_variance(torch.ones(1, 4), ret, mask), 0.0, abs_tol=1e-6)


def test_entropy_and_kl_enter_the_actor_loss_with_their_coefficients(tokenizer):
    from components.batch import Batch
    from components.settings import UpdateSettings
    from components.training.actor import PolicyTrainer
    from tests.conftest import make_model

    g = torch.Generator().manual_seed(0)
    n, vocab = 4, len(tokenizer)
    batch = Batch(
        {
            "prompts": torch.randint(3, vocab, (n, 3), generator=g),
            "prompt_mask": torch.ones(n, 3, dtype=torch.long),
            "responses": torch.randint(3, vocab, (n, 4), generator=g),
            "response_mask": torch.ones(n, 4, dtype=torch.long),
            "advantages": torch.zeros(n, 4),
        }
    )
    ref = make_model(tokenizer, seed=1)
    trainer = PolicyTrainer(
        make_model(tokenizer), ref, None, None, UpdateSettings(beta=0.5, entropy_coeff=0.1, kl_loss_type="k1")
    )
    batch = trainer.prepare(batch)
    agg = AggParams(float(n * 4), float(n))
    loss, m = trainer._micro_loss(batch, agg)
    # zero advantages: pg_loss = 0, so loss = -0.1 H + 0.5 KL exactly
    assert float(m["actor/pg_loss"]) == 0.0
    assert math.isclose(
        float(loss), -0.1 * float(m["actor/entropy"]) + 0.5 * float(m["actor/kl_loss"]), rel_tol=1e-6
    )
    assert float(m["actor/kl_loss"]) != 0.0


def _vanilla_loop(logp, old, adv, mask, low, high, c):
    """Token by token, as the paper writes it; token-mean over the mask."""
    total, count, clipped = 0.0, 0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            ratio = math.exp(max(-20.0, min(20.0, float(logp[i, t] - old[i, t]))))
            a = float(adv[i, t])
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
            loss = max(l1, l2)
            if a < 0:
                loss = min(loss, -a * c)
            total, count, clipped = total + loss, count + 1, clipped + (l2 > l1)
    return total / count, clipped / count


def test_vanilla_ppo_loop_equals_vectorized():
    g = torch.Generator().manual_seed(9)
    logp, old = -torch.rand(5, 6, generator=g) * 2, -torch.rand(5, 6, generator=g) * 2
    adv = torch.randn(5, 6, generator=g) * 2
    mask = (torch.rand(5, 6, generator=g) > 0.3).float()
    loss, m = vanilla_ppo(
        logp, old, adv, mask, PolicyLossParams(0.2, 0.28, 3.0), AggParams(float(mask.sum()), 5)
    )
    expected, clipfrac = _vanilla_loop(logp, old, adv, mask, 0.2, 0.28, 3.0)
    assert math.isclose(float(loss), expected, rel_tol=1e-5)
    assert math.isclose(float(m["actor/pg_clipfrac"]), clipfrac, rel_tol=1e-6)


# ---- the 2025-26 policy losses: each against a hand-computed case -----------------------------------------


def _loss(name, logp, old, adv, mask, params, agg):
    from components.algorithms.losses import POLICY_LOSSES

    return POLICY_LOSSES.get(name)(logp, old, adv, mask, params, agg)


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("adv, tau", [(1.0, 1.0), (-1.0, 1.05)])
def test_sapo_is_the_soft_gate_with_the_signs_temperature(adv, tau):
    # ratio 1.2: loss -A 4/tau sigmoid(tau 0.2); gradient wrt logp -A 4 s (1 - s) ratio
    logp = torch.tensor([[math.log(1.2)]], requires_grad=True)
    loss, m = _loss(
        "sapo",
        logp,
        torch.zeros(1, 1),
        torch.tensor([[adv]]),
        torch.ones(1, 1),
        PolicyLossParams(),
        AggParams(1, 1),
    )
    s = _sigmoid(tau * 0.2)
    assert math.isclose(float(loss), -adv * 4 / tau * s, rel_tol=1e-6)
    loss.backward()
    assert math.isclose(float(logp.grad), -adv * 4 * s * (1 - s) * 1.2, rel_tol=1e-5)
    assert float(m["actor/pg_clipfrac"]) == 0.0  # the gate weight 0.99 is not below one half


def test_sapo_matches_the_plain_gradient_at_ratio_one_and_damps_far_tokens():
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.tensor([[0.0, -3.0]])  # ratios 1 and e^3 = 20
    loss, m = _loss(
        "sapo", logp, old, torch.ones(1, 2), torch.ones(1, 2), PolicyLossParams(), AggParams(2, 1)
    )
    loss.backward()
    assert math.isclose(float(logp.grad[0, 0]), -0.5, rel_tol=1e-6)  # -A / N_tokens, as vanilla
    assert abs(float(logp.grad[0, 1])) < 1e-5  # sigmoid(19) saturates: no push
    assert float(m["actor/pg_clipfrac"]) == 0.5


def test_gmpo_clips_each_log_ratio_on_the_pessimistic_side_then_takes_the_geometric_mean():
    p = PolicyLossParams(clip_low=0.4, clip_high=0.4, agg_mode="seq-mean-token-mean")
    # A > 0, x = [0.1, 0.6]: the 0.6 is clipped to 0.4; mean 0.25; L = -e^0.25
    logp = torch.tensor([[0.1, 0.6]], requires_grad=True)
    loss, m = _loss("gmpo", logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), p, AggParams(2, 1))
    assert math.isclose(float(loss), -math.exp(0.25), rel_tol=1e-6)
    loss.backward()
    assert math.isclose(float(logp.grad[0, 0]), -math.exp(0.25) / 2, rel_tol=1e-5)
    assert float(logp.grad[0, 1]) == 0.0 and float(m["actor/pg_clipfrac"]) == 0.5
    # A < 0, x = [0.1, -0.6]: the -0.6 is clipped to -0.4; a large x stays (pessimistic); L = +e^-0.15
    logp = torch.tensor([[0.1, -0.6]])
    loss, _ = _loss("gmpo", logp, torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2), p, AggParams(2, 1))
    assert math.isclose(float(loss), math.exp(-0.15), rel_tol=1e-6)
    loss, _ = _loss(
        "gmpo",
        torch.tensor([[0.6]]),
        torch.zeros(1, 1),
        -torch.ones(1, 1),
        torch.ones(1, 1),
        p,
        AggParams(1, 1),
    )
    assert math.isclose(float(loss), math.exp(0.6), rel_tol=1e-6)


# four tokens at ratio 1; logp [-0.5, -2.5, -1.5, -1.5] (mean -1.5), A [2, -2, 0, 0] (mean 0):
# covariances (A - mean A)(logp - mean logp) = [2, 2, 0, 0]
COV_LOGP = torch.tensor([[-0.5, -2.5, -1.5, -1.5]])
COV_ADV = torch.tensor([[2.0, -2.0, 0.0, 0.0]])


def test_clip_cov_cuts_the_gradient_of_drawn_tokens_in_the_covariance_band():
    p = PolicyLossParams(clip_cov_ratio=0.25, clip_cov_lb=1.0, clip_cov_ub=5.0)
    logp = COV_LOGP.clone().requires_grad_(True)
    loss, m = _loss("clip_cov", logp, COV_LOGP, COV_ADV, torch.ones(1, 4), p, AggParams(4, 1))
    loss.backward()
    cut = (logp.grad[0] == 0) & (COV_ADV[0] != 0)
    assert int(cut.sum()) == 1  # one of the two in the band (0.25 of 4 tokens)
    kept = 1 - int(cut.nonzero())  # the other token keeps -A / 4
    assert math.isclose(float(logp.grad[0, kept]), -float(COV_ADV[0, kept]) / 4, rel_tol=1e-6)
    assert math.isclose(float(loss), -float(COV_ADV[0, kept]) / 4, rel_tol=1e-6)
    assert float(m["actor/pg_clipfrac"]) == 0.25
    again, _ = _loss("clip_cov", COV_LOGP.clone(), COV_LOGP, COV_ADV, torch.ones(1, 4), p, AggParams(4, 1))
    assert float(again) == float(loss)  # the draw is seeded


def test_clip_cov_outside_the_band_is_vanilla_ppo():
    p = PolicyLossParams(clip_cov_ratio=0.25, clip_cov_lb=2.5, clip_cov_ub=5.0)  # covariances 2 < 2.5
    args = (COV_LOGP, COV_LOGP, COV_ADV, torch.ones(1, 4))
    loss, m = _loss("clip_cov", *args, p, AggParams(4, 1))
    assert (
        float(loss) == float(vanilla_ppo(*args, p, AggParams(4, 1))[0]) and float(m["actor/pg_clipfrac"]) == 0
    )


def test_kl_cov_penalises_the_top_covariance_token():
    # A [2, -3, 0, 0] (mean -0.25): covariances [2.25, 2.75, 0, 0]; the top one (token 1) is penalised
    adv = torch.tensor([[2.0, -3.0, 0.0, 0.0]])
    x = torch.tensor([[0.1, -0.2, 0.0, 0.0]])
    p = PolicyLossParams(kl_cov_ratio=0.25, kl_cov_coef=1.0)
    loss, m = _loss("kl_cov", COV_LOGP, COV_LOGP - x, adv, torch.ones(1, 4), p, AggParams(4, 1))
    expected = (-2 * math.exp(0.1) + 3 * math.exp(-0.2) + 0.2) / 4
    assert math.isclose(float(loss), expected, rel_tol=1e-6)
    assert float(m["actor/pg_clipfrac"]) == 0.25


def test_gpg_is_the_plain_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, m = _loss(
        "gpg",
        logp,
        logp.detach() - 5,
        torch.tensor([[1.0, 1.0]]),
        torch.ones(1, 2),
        PolicyLossParams(),
        AggParams(2, 1),
    )
    assert math.isclose(float(loss), 1.5, rel_tol=1e-6)  # -(1 * -1 + 1 * -2) / 2, whatever the old policy
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5]]))
    assert float(m["actor/pg_clipfrac"]) == 0.0


def test_the_gpg_estimator_scales_by_the_share_of_groups_with_signal():
    from components.algorithms.advantages import ADVANTAGES, AdvantageParams

    # group 0 scores [1, 0], group 1 [1, 1] (no signal): B = 4, M = 2, alpha = 2
    rewards = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
    adv, _ = ADVANTAGES.get("gpg")(
        rewards, torch.ones(4, 1), torch.tensor([0, 0, 1, 1]), None, AdvantageParams(norm_adv_by_std=False)
    )
    assert adv.flatten().tolist() == [1.0, -1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.policy_loss=sapoo", r"algorithm\.policy_loss=sapoo: unknown policy loss.*sapo"),
        ("algorithm.clip_cov_lb=9", r"algorithm\.clip_cov_lb=9.0 is not below algorithm\.clip_cov_ub"),
        ("algorithm.sapo_tau_neg=0", r"algorithm\.sapo_tau_neg"),
    ],
)
def test_a_bad_loss_setting_names_its_key(override, message):
    from components.errors import ConfigError
    from components.validate import load_checked

    with pytest.raises(ConfigError, match=message):
        load_checked("configs/arith_grpo.yaml", [override])


def test_the_generalised_jsd_against_a_hand_computed_case():
    from components.algorithms.losses import generalized_jsd

    s_p, t_p = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])
    student, teacher = s_p.log()[None, None], t_p.log()[None, None]
    m = 0.5 * s_p + 0.5 * t_p  # [0.7, 0.3]
    kl = lambda p, q: float((p * (p / q).log()).sum())  # noqa: E731
    half = 0.5 * kl(t_p, m) + 0.5 * kl(s_p, m)
    assert math.isclose(float(generalized_jsd(student, teacher, 0.5)), half, rel_tol=1e-5)
    assert math.isclose(float(generalized_jsd(student, teacher, 0.0)), kl(t_p, s_p), rel_tol=1e-5)
    assert math.isclose(float(generalized_jsd(student, teacher, 1.0)), kl(s_p, t_p), rel_tol=1e-5)
    # beta -> 0 and -> 1 approach the ends' KLs divided away (JSD_beta / beta -> KL(T || S) as beta -> 0)
    assert math.isclose(float(generalized_jsd(student, teacher, 1e-4)) / 1e-4, kl(t_p, s_p), rel_tol=1e-2)
    assert float(generalized_jsd(student, student, 0.3)) == pytest.approx(0.0, abs=1e-7)
