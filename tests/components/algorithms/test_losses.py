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
