"""Loss aggregation, KL estimators and policy losses: pure tensor functions in registries.

Shapes: every per-token tensor is (B, T); response_mask is 1 on generated tokens.
"""

from __future__ import annotations

import math
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


@POLICY_LOSSES.register("sapo")
def sapo(logp, old_logp, advantages, mask, p: PolicyLossParams, agg: AggParams):
    """SAPO (Qwen, arXiv 2511.20347): a soft gate in place of the hard clip.

    L = -A f(ratio) with f(r) = 4/tau sigmoid(tau (r - 1)), tau = sapo_tau_pos where A > 0 and sapo_tau_neg
    elsewhere (the paper's 1.0 / 1.05: negative tokens are damped faster). The gradient weight of a token is
    4 sigmoid (1 - sigmoid) ratio: ratio itself at ratio 1, falling smoothly as the ratio leaves 1, where the
    hard clip would cut it to 0. pg_clipfrac counts the tokens whose gate weight is below one half.
    """
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    tau = torch.where(advantages > 0, p.sapo_tau_pos, p.sapo_tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1))
    per_token = -advantages * gate * 4 / tau
    damped = (4 * gate * (1 - gate)).detach() < 0.5
    metrics = _ratio_metrics(mask, agg, logp - old_logp, damped, damped & (ratio.detach() < 1))
    return agg_loss(per_token, mask, p.agg_mode, agg), metrics


@POLICY_LOSSES.register("gmpo")
def gmpo(logp, old_logp, advantages, mask, p: PolicyLossParams, agg: AggParams):
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios over the sequence, clipped per token
    in log space, replaces the arithmetic mean of clipped ratios.

    Each token's log-ratio x is clipped to [-clip_low, clip_high] on the side its advantage's sign makes
    pessimistic (sign(A) min(sign(A) x, sign(A) clip(x))); the sequence ratio is exp(mean_t of those), and
    L_i = -A_i ratio_i with A_i the sequence's mean advantage. The per-sequence loss is broadcast over its
    tokens, so `seq-mean-token-mean` (the paper's) gives mean_i L_i. The paper's bounds are 0.4 both ways
    (`clip_epsilon=0.4 clip_ratio_high=0.4`); the defaults here are PPO's 0.2.
    """
    x = (logp - old_logp).clamp(-20, 20)
    sign = torch.sign(advantages)
    clipped_x = x.clamp(-p.clip_low, p.clip_high)
    kept = sign * torch.minimum(sign * x, sign * clipped_x)
    lengths = mask.sum(-1).clamp(min=1)
    log_ratio = (kept * mask).sum(-1) / lengths  # (B,)
    seq_adv = (advantages * mask).sum(-1) / lengths  # (B,)
    per_seq = -seq_adv * torch.exp(log_ratio)
    per_token = per_seq[:, None].expand_as(mask)
    cut = (clipped_x != x).detach()
    metrics = _ratio_metrics(mask, agg, x, cut, cut & (x < -p.clip_low))
    return agg_loss(per_token, mask, p.agg_mode, agg), metrics


def _centred_covariance(logp, advantages, mask) -> torch.Tensor:
    """(A - mean A)(logp - mean logp) per token (B, T), the means over the masked tokens: the covariance
    term by which a token drives the policy's entropy down (arXiv 2505.22617, eq. 9)."""
    n = mask.sum().clamp(min=1)
    lp = logp.detach()
    return (advantages - (advantages * mask).sum() / n) * (lp - (lp * mask).sum() / n)


@POLICY_LOSSES.register("clip_cov")
def clip_cov(logp, old_logp, advantages, mask, p: PolicyLossParams, agg: AggParams):
    """Clip-Cov (arXiv 2505.22617, "The Entropy Mechanism of RL for Reasoning LMs"): PPO's clipped loss,
    and in addition a fraction `clip_cov_ratio` of the tokens, drawn at random among those whose covariance
    lies in (clip_cov_lb, clip_cov_ub) and that the ratio clip has not already cut, lose their gradient.

    The draw is seeded (`trainer.seed` with the batch's token count) so a rerun cuts the same tokens. At
    least one token is drawn when any is eligible, as in the paper's code. pg_clipfrac counts the cut ones.
    """
    x = (logp - old_logp).clamp(-20, 20)
    ratio = torch.exp(x)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - p.clip_low, 1 + p.clip_high)
    by_ratio = (pg2 > pg1) & mask.bool()
    cov = _centred_covariance(logp, advantages, mask)
    eligible = (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub) & mask.bool() & ~by_ratio
    where = eligible.flatten().nonzero().squeeze(-1)
    n_cut = min(max(int(p.clip_cov_ratio * float(mask.sum())), 1), len(where))
    generator = torch.Generator().manual_seed(p.seed * 1_000_003 + int(mask.sum()))
    chosen = where[torch.randperm(len(where), generator=generator)[:n_cut]]
    keep = torch.ones(mask.numel()).index_fill_(0, chosen, 0.0).view_as(mask)
    per_token = torch.maximum(pg1, pg2) * keep
    cut = (keep == 0) | by_ratio
    metrics = _ratio_metrics(mask, agg, x, cut, cut & (ratio.detach() < 1))
    return agg_loss(per_token, mask, p.agg_mode, agg), metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov(logp, old_logp, advantages, mask, p: PolicyLossParams, agg: AggParams):
    """KL-Cov (arXiv 2505.22617): no ratio clip; the top `kl_cov_ratio` fraction of the masked tokens by
    covariance (at least one) get a KL penalty kl_cov_coef |logp - old_logp| added to -A ratio.

    pg_clipfrac counts the penalised tokens.
    """
    x = (logp - old_logp).clamp(-20, 20)
    per_token = -advantages * torch.exp(x)
    cov = _centred_covariance(logp, advantages, mask).masked_fill(~mask.bool(), float("-inf"))
    n_valid = int(mask.sum())
    k = min(max(int(p.kl_cov_ratio * n_valid), 1), n_valid)
    penalised = torch.zeros(mask.numel(), dtype=torch.bool)
    penalised[cov.flatten().topk(k).indices] = True
    penalised = penalised.view_as(mask)
    per_token = torch.where(penalised, per_token + p.kl_cov_coef * x.abs(), per_token)
    metrics = _ratio_metrics(mask, agg, x, penalised, torch.zeros_like(penalised))
    return agg_loss(per_token, mask, p.agg_mode, agg), metrics


@POLICY_LOSSES.register("gpg")
def gpg(logp, old_logp, advantages, mask, p: PolicyLossParams, agg: AggParams):
    """GPG (Group Policy Gradient, arXiv 2504.02546): plain policy gradient, no ratio and no clip,
    L = -A logp. Pair it with the `gpg` estimator (the `gpg` preset does), whose advantages carry the
    paper's correction for groups without signal. Metrics: no token is clipped; ppo_kl as the others."""
    per_token = -advantages * logp
    none = torch.zeros_like(mask, dtype=torch.bool)
    return agg_loss(per_token, mask, p.agg_mode, agg), _ratio_metrics(mask, agg, logp - old_logp, none, none)


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalised Jensen-Shannon divergence (arXiv 2306.13649) per position, over the vocabulary.

    student, teacher: log-probabilities (N, R, V). With M = beta P_T + (1 - beta) P_S:
    JSD_beta = beta KL(P_T || M) + (1 - beta) KL(P_S || M); at the ends (as TRL's GKDTrainer) beta = 0 is the
    forward KL(P_T || P_S) and beta = 1 the reverse KL(P_S || P_T). Returns (N, R).

    >>> p = torch.log(torch.tensor([[[0.5, 0.5]]])); q = torch.log(torch.tensor([[[0.9, 0.1]]]))
    >>> round(float(generalized_jsd(p, q, 1.0)), 4), round(float(generalized_jsd(p, p, 0.5)), 4)
    (0.5108, 0.0)
    """
    if beta == 0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1:
        return (student.exp() * (student - teacher)).sum(-1)
    mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log(1 - beta)]), dim=0)
    kl_teacher = (teacher.exp() * (teacher - mixture)).sum(-1)
    kl_student = (student.exp() * (student - mixture)).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


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
