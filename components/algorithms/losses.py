"""Loss aggregation, KL estimators and policy losses: pure tensor functions in registries.

Shapes: every per-token tensor is (B, T); response_mask is 1 on generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from components.algorithms.registry import Registry
from components.settings import PolicyLossParams

AGG_MODES: Registry = Registry("loss aggregation mode", "algorithm.loss_agg_mode")
KL_ESTIMATORS: Registry = Registry("KL estimator", "algorithm.kl_loss_type")
POLICY_LOSSES: Registry = Registry("policy loss", "algorithm.policy_loss")


@dataclass(frozen=True)
class AggParams:
    """Global counts across every micro-batch and data-parallel rank, so the sum of the parts is the whole."""

    num_tokens: float  # masked tokens in the whole mini-batch
    num_seqs: float  # sequences in the whole mini-batch
    norm_const: float = 1.0  # seq-mean-token-sum-norm: the constant (max response length)


@AGG_MODES.register("token-mean")
def token_mean(loss, mask, p: AggParams):
    """sum(L * m) / N_tokens."""
    return (loss * mask).sum() / p.num_tokens


@AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(loss, mask, p: AggParams):
    """mean over sequences of sum_t L * m."""
    return (loss * mask).sum() / p.num_seqs


@AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(loss, mask, p: AggParams):
    """mean over sequences of (sum_t L * m / |o_i|)."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / p.num_seqs


@AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss, mask, p: AggParams):
    """sum(L * m) / (N_seqs * norm_const): Dr.GRPO's constant normaliser."""
    return (loss * mask).sum() / (p.num_seqs * p.norm_const)


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, params: AggParams) -> torch.Tensor:
    """Reduce a (B, T) loss to a scalar with the named mode."""
    return AGG_MODES.get(mode)(loss, mask, params)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp, ref_logp):
    """log pi - log pi_ref."""
    return logp - ref_logp


@KL_ESTIMATORS.register("abs")
def kl_abs(logp, ref_logp):
    """|log pi - log pi_ref|."""
    return (logp - ref_logp).abs()


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(logp, ref_logp):
    """1/2 (log pi - log pi_ref)^2."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(logp, ref_logp):
    """Schulman's k3: x = clamp(log pi_ref - log pi, +-20); e^x - x - 1, clamped to [-10, 10]."""
    x = (ref_logp - logp).clamp(-20, 20)
    return (torch.exp(x) - x - 1).clamp(-10, 10)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (B, T) by name; `<name>+` is the straight-through form (k3 value, k2 gradient)."""
    if kind.endswith("+"):
        base = KL_ESTIMATORS.get(kind[:-1])(logp, ref_logp)
        grad = kl_k2(logp, ref_logp)
        return grad - grad.detach() + base.detach()
    return KL_ESTIMATORS.get(kind)(logp, ref_logp)


def _ratio_metrics(mask, agg: AggParams, log_ratio, clipped, clipped_lower) -> dict[str, torch.Tensor]:
    """pg_clipfrac, pg_clipfrac_lower (fractions of masked tokens) and ppo_kl = mean(-log_ratio), where
    log_ratio = logp - old_logp as the loss used it."""
    tok = AggParams(agg.num_tokens, agg.num_seqs)
    return {
        "actor/pg_clipfrac": token_mean(clipped.float(), mask, tok),
        "actor/pg_clipfrac_lower": token_mean(clipped_lower.float(), mask, tok),
        "actor/ppo_kl": token_mean(-log_ratio.detach(), mask, tok),
    }


@POLICY_LOSSES.register("vanilla")
def vanilla_ppo(logp, old_logp, advantages, mask, p: PolicyLossParams, agg: AggParams):
    """PPO clip (arXiv 1707.06347) with asymmetric bounds and dual clip (arXiv 1912.09729).

    ratio = exp(clamp(logp - old_logp, +-20)); L1 = -A ratio; L2 = -A clip(ratio, 1-low, 1+high);
    Lc = max(L1, L2); for A < 0 the loss is min(Lc, -A c). Returns (scalar loss, metrics of 0-dim tensors).
    """
    neg_kl = (logp - old_logp).clamp(-20, 20)
    ratio = torch.exp(neg_kl)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - p.clip_low, 1 + p.clip_high)
    clipped = torch.maximum(pg1, pg2)
    pg3 = -advantages * p.clip_ratio_c
    dual = torch.minimum(pg3, clipped)
    per_token = torch.where(advantages < 0, dual, clipped)
    metrics = _ratio_metrics(mask, agg, neg_kl, pg2 > pg1, (clipped > pg3) & (advantages < 0))
    return agg_loss(per_token, mask, p.agg_mode, agg), metrics


@POLICY_LOSSES.register("gspo")
def gspo(logp, old_logp, advantages, mask, p: PolicyLossParams, agg: AggParams):
    """GSPO (arXiv 2507.18071): the importance ratio is per sequence, s_i = exp(mean_t (logp - old_logp)).

    Token form s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]: its value is s_i, its gradient that of the token;
    loss = max(-A s, -A clip(s, 1-low, 1+high)). GSPO's clip ranges are small (3e-4 / 4e-4 in the paper).
    """
    lengths = mask.sum(-1).clamp(min=1)
    log_s = ((logp - old_logp) * mask).sum(-1) / lengths  # (B,)
    log_s_tok = logp - logp.detach() + log_s.detach()[:, None]
    ratio = torch.exp(log_s_tok.clamp(max=10.0))
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - p.clip_low, 1 + p.clip_high)
    per_token = torch.maximum(pg1, pg2)
    metrics = _ratio_metrics(mask, agg, logp - old_logp, pg2 > pg1, torch.zeros_like(mask, dtype=torch.bool))
    return agg_loss(per_token, mask, p.agg_mode, agg), metrics


@POLICY_LOSSES.register("cispo")
def cispo(logp, old_logp, advantages, mask, p: PolicyLossParams, agg: AggParams):
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update; the weight is a
    constant (stop-gradient), so every token keeps a gradient: L = -sg(clip(ratio, 1-low, 1+high)) A logp."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    weight = ratio.clamp(1 - p.clip_low, 1 + p.clip_high).detach()
    per_token = -advantages * weight * logp
    metrics = _ratio_metrics(
        mask, agg, logp - old_logp, weight != ratio.detach(), ratio.detach() < 1 - p.clip_low
    )
    return agg_loss(per_token, mask, p.agg_mode, agg), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    agg_mode: str,
    agg: AggParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO's critic): 1/2 agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2)).

    values, old_values, returns, mask: (B, T). Returns the scalar loss and critic/vf_clipfrac, the fraction
    of masked tokens where the clipped term is the larger one.
    """
    clipped = old_values + (values - old_values).clamp(-cliprange, cliprange)
    vf1 = (values - returns) ** 2
    vf2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(vf1, vf2), mask, agg_mode, agg)
    tok = AggParams(agg.num_tokens, agg.num_seqs)
    return loss, {"critic/vf_clipfrac": token_mean((vf2 > vf1).float(), mask, tok)}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over masked tokens (1 = perfect critic, 0 = no better than a constant)."""
    m = mask.bool()
    r, v = returns[m], values[m]
    var_r = r.var(unbiased=False)
    return float(1 - (r - v).var(unbiased=False) / var_r) if var_r > 0 else 0.0
