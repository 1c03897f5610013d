"""Advantage estimators: pure tensor functions, one signature, in one registry.

Every estimator is `fn(token_rewards, response_mask, group_ids, values, params) -> (advantages, returns)`:
  token_rewards (B, T) float: reward per response token (the sequence score sits on its last token)
  response_mask (B, T) {0,1}: 1 on generated tokens
  group_ids     (B,)   long: responses to the same prompt share an id
  values        (B, T) float or None: critic values (gae), or the greedy-decode baseline score
                broadcast over the tokens (remax); None for the others
returns advantages (B, T) and returns (B, T), both zero where response_mask is 0.
Formulas follow verl's core_algos (see ../shared/reference/anchors.md).

What an estimator needs is registered with it and read with `ADVANTAGES.info(name)`:
  grouped=True          compares completions of one prompt (needs engine.n >= 2)
  needs_values=True     critic values (the PPO preset trains a critic)
  needs_baseline=True   the score of a greedy completion per prompt (the rollout stage samples it)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from components.algorithms.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator", "algorithm.adv_estimator")


@dataclass(frozen=True)
class AdvantageParams:
    norm_adv_by_std: bool = True  # GRPO: divide by the group std (False = Dr.GRPO)
    epsilon: float = 1e-6  # added to the std before dividing
    gamma: float = 1.0  # discount (GAE, REINFORCE++)
    lam: float = 1.0  # GAE lambda


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group index (B,) in 0..n-1 for arbitrary ids, and n."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, (int(inverse.max()) + 1 if inverse.numel() else 0)


def group_sum(values: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Sum of `values` (B,) per group -> (n_groups,)."""
    return torch.zeros(n_groups, dtype=values.dtype).index_add_(0, inverse, values)


def group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response group mean, unbiased std and group size. scores (B,), group_ids (B,) -> 3 x (B,).

    A group of one gets mean 0 and std 1, as in verl, so its advantage is its raw score.
    """
    inverse, n_groups = group_index(group_ids)
    count = group_sum(torch.ones_like(scores), inverse, n_groups)
    mean = group_sum(scores, inverse, n_groups) / count
    sq = group_sum((scores - mean[inverse]) ** 2, inverse, n_groups)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[inverse], std[inverse], count[inverse]


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries (unbiased variance); zero outside the mask."""
    n = mask.sum().clamp(min=1)
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = per_seq[:, None] * mask
    return adv, adv


@ADVANTAGES.register("grpo", grouped=True)
def grpo(token_rewards, response_mask, group_ids, values, params: AdvantageParams):
    """GRPO (arXiv 2402.03300): A_i = (r_i - mean_g) / (std_g + eps); Dr.GRPO drops the division."""
    scores = (token_rewards * response_mask).sum(-1)
    mean, std, _ = group_stats(scores, group_ids)
    adv = scores - mean
    if params.norm_adv_by_std:
        adv = adv / (std + params.epsilon)
    return _broadcast(adv, response_mask)


@ADVANTAGES.register("dr_grpo", grouped=True)
def dr_grpo(token_rewards, response_mask, group_ids, values, params: AdvantageParams):
    """Dr.GRPO (arXiv 2503.20783): A_i = r_i - mean_g, whatever norm_adv_by_std says (pair it with the
    seq-mean-token-sum-norm aggregation, as the dr_grpo preset does)."""
    return grpo(token_rewards, response_mask, group_ids, values, replace(params, norm_adv_by_std=False))


@ADVANTAGES.register("rloo", grouped=True)
def rloo(token_rewards, response_mask, group_ids, values, params: AdvantageParams):
    """RLOO (arXiv 2402.14740): A_i = r_i - mean of the others = n/(n-1) (r_i - mean_g); a group of one keeps r_i."""
    scores = (token_rewards * response_mask).sum(-1)
    mean, _, count = group_stats(scores, group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.ones_like(count))
    return _broadcast((scores - mean) * scale, response_mask)


@ADVANTAGES.register("gpg", grouped=True)
def gpg(token_rewards, response_mask, group_ids, values, params: AdvantageParams):
    """GPG (arXiv 2504.02546): A_i = alpha (r_i - mean_g) / F_norm, F_norm = std_g + eps when
    norm_adv_by_std (the gpg preset: 1). alpha = B / (B - M), M the responses in groups whose rewards are all
    equal: they carry no gradient, and alpha scales the others' up so the batch's gradient keeps its size."""
    scores = (token_rewards * response_mask).sum(-1)
    mean, std, count = group_stats(scores, group_ids)
    inverse, n_groups = group_index(group_ids)
    spread = group_sum((scores - mean).abs(), inverse, n_groups)[inverse]
    flat = int(((spread == 0) & (count > 1)).sum())
    alpha = len(scores) / max(len(scores) - flat, 1)
    adv = alpha * (scores - mean)
    if params.norm_adv_by_std:
        adv = adv / (std + params.epsilon)
    return _broadcast(adv, response_mask)


@ADVANTAGES.register("reinforce_plus_plus_baseline", grouped=True)
def reinforce_plus_plus_baseline(token_rewards, response_mask, group_ids, values, params: AdvantageParams):
    """REINFORCE++-baseline (arXiv 2501.03262): r_i - mean_g broadcast over tokens, then whitened over the batch."""
    scores = (token_rewards * response_mask).sum(-1)
    mean, _, _ = group_stats(scores, group_ids)
    adv = masked_whiten((scores - mean)[:, None] * response_mask, response_mask)
    return adv, adv


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over masked tokens. (B, T) -> (B, T)."""
    out = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running * mask[:, t]
        out[:, t] = running
        running = running * mask[:, t]
    return out * mask


@ADVANTAGES.register("reinforce_plus_plus")
def reinforce_plus_plus(token_rewards, response_mask, group_ids, values, params: AdvantageParams):
    """REINFORCE++: discounted return per token, whitened over the batch; returns are the raw returns."""
    returns = discounted_returns(token_rewards * response_mask, response_mask, params.gamma)
    return masked_whiten(returns, response_mask), returns


@ADVANTAGES.register("gae", needs_values=True)
def gae(token_rewards, response_mask, group_ids, values, params: AdvantageParams):
    """GAE (arXiv 1506.02438): delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lam A_{t+1};
    returns = A + V; advantages whitened over the masked tokens. Masked positions are skipped."""
    if values is None:
        raise ValueError("gae needs critic values; use algorithm.name=ppo, which trains a critic")
    B, T = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(B, dtype=values.dtype)
    next_adv = torch.zeros(B, dtype=values.dtype)
    for t in reversed(range(T)):
        m = response_mask[:, t]
        delta = token_rewards[:, t] + params.gamma * next_value - values[:, t]
        a = delta + params.gamma * params.lam * next_adv
        adv[:, t] = a * m
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, a, next_adv)
    returns = (adv + values) * response_mask
    return masked_whiten(adv, response_mask), returns


@ADVANTAGES.register("opo", grouped=True)
def opo(token_rewards, response_mask, group_ids, values, params: AdvantageParams):
    """OPO (arXiv 2505.23585): baseline = length-weighted group mean sum(|o_j| r_j) / sum |o_j|; A_i = r_i - b."""
    scores = (token_rewards * response_mask).sum(-1)
    lengths = response_mask.sum(-1)
    inverse, n = group_index(group_ids)
    baseline = (group_sum(lengths * scores, inverse, n) / group_sum(lengths, inverse, n).clamp(min=1))[
        inverse
    ]
    return _broadcast(scores - baseline, response_mask)


@ADVANTAGES.register("grpo_passk", grouped=True)
def grpo_passk(token_rewards, response_mask, group_ids, values, params: AdvantageParams):
    """Pass@k GRPO (arXiv 2503.19595): only the best response of a group gets (r_max - r_2nd) / (std + eps)
    (no std division when norm_adv_by_std is False); every other response, and a group of one, gets 0."""
    scores = (token_rewards * response_mask).sum(-1)
    _, std, _ = group_stats(scores, group_ids)
    adv = torch.zeros_like(scores)
    for gid in torch.unique(group_ids):
        idx = (group_ids == gid).nonzero().squeeze(-1)
        if len(idx) < 2:
            continue
        top2 = torch.topk(scores[idx], 2)
        gap = top2.values[0] - top2.values[1]
        best = idx[top2.indices[0]]
        adv[best] = gap / (std[best] + params.epsilon) if params.norm_adv_by_std else gap
    return _broadcast(adv, response_mask)


@ADVANTAGES.register("remax", needs_baseline=True)
def remax(token_rewards, response_mask, group_ids, values, params: AdvantageParams):
    """ReMax (arXiv 2310.10505): A_t = G_t - b, where G_t is the undiscounted reward-to-go and b the score of
    the greedy completion for the same prompt, given here as `values` (B, T). No whitening (as in verl)."""
    if values is None:
        raise ValueError(
            "remax needs the greedy-decode baseline; use algorithm.name=remax, whose rollout stage "
            "samples one greedy completion per prompt"
        )
    returns = discounted_returns(token_rewards * response_mask, response_mask, 1.0)
    adv = (returns - values) * response_mask
    return adv, returns
