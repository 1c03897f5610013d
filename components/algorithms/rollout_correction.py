"""Off-policy correction between the rollout engine and the trainer (algorithm.rollout_correction): the
samples were drawn by the engine's distribution (vLLM's kernels, bf16, an older policy version when rollout
runs ahead), while the update's importance ratio is taken against the trainer's old log-probs. Each token's
importance weight w = pi_old / pi_rollout = exp(old_logprobs - rollout_logprobs) corrects for it:

- `tis`: token-level truncated IS, the loss of each token weighted by min(w, cap);
- `mis`: token-level masked IS, tokens with w outside [1/cap, cap] get weight 0, the others 1;
- `seq_tis`: the sequence's weight W = prod_t w_t (over its response tokens), truncated at cap, for every
  token of the sequence;
- `seq_mis`: sequences with W outside [1/cap, cap] get weight 0, the others 1.

Every function here has one signature: (old_logprobs (N, R), rollout_logprobs (N, R), mask (N, R), cap) ->
weights (N, R), detached and 0 off the mask, and `changed` (N, R) bool, the tokens whose weight the cap moved
(truncated or masked). The weights multiply the advantages (the clipped PPO loss is linear in them for a
positive weight), so every policy loss and aggregation mode takes them unchanged.
"""

from __future__ import annotations

import math

import torch

from components.algorithms.registry import Registry

# mode -> (old, rollout, mask, cap) -> (weights, changed)
ROLLOUT_CORRECTIONS: Registry = Registry("rollout correction", "algorithm.rollout_correction.mode")


def _token_log_weights(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (old - rollout).detach() * mask


def _sequence_log_weights(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log W of each sequence, broadcast over its tokens (N, R)."""
    return _token_log_weights(old, rollout, mask).sum(-1, keepdim=True).expand_as(mask)


def _truncated(log_w: torch.Tensor, mask: torch.Tensor, cap: float):
    """min(w, cap) where log w is `log_w` (N, R); changed where the cap bit."""
    return log_w.exp().clamp(max=cap) * mask, (log_w > math.log(cap)) & mask.bool()


def _masked(log_w: torch.Tensor, mask: torch.Tensor, cap: float):
    """1 where w lies in [1/cap, cap], 0 elsewhere; changed where it is 0."""
    out = (log_w.abs() > math.log(cap)) & mask.bool()
    return (~out).float() * mask, out


@ROLLOUT_CORRECTIONS.register("tis")
def token_truncated(old, rollout, mask, cap):
    """min(w_t, cap) on each token.

    >>> w, c = token_truncated(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2), 2.0)
    >>> w.tolist(), c.tolist()
    ([[1.0, 2.0]], [[False, True]])
    """
    return _truncated(_token_log_weights(old, rollout, mask), mask, cap)


@ROLLOUT_CORRECTIONS.register("mis")
def token_masked(old, rollout, mask, cap):
    """1 where w_t lies in [1/cap, cap], 0 elsewhere."""
    return _masked(_token_log_weights(old, rollout, mask), mask, cap)


@ROLLOUT_CORRECTIONS.register("seq_tis")
def sequence_truncated(old, rollout, mask, cap):
    """min(W, cap), W the product of the sequence's token weights, on each of its tokens."""
    return _truncated(_sequence_log_weights(old, rollout, mask), mask, cap)


@ROLLOUT_CORRECTIONS.register("seq_mis")
def sequence_masked(old, rollout, mask, cap):
    """1 on the tokens of sequences whose W lies in [1/cap, cap], 0 on the others."""
    return _masked(_sequence_log_weights(old, rollout, mask), mask, cap)


def correct_advantages(
    advantages: torch.Tensor,
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantages (N, R) weighted by the correction `mode`, and its metrics: `rollout_corr/weight_mean`
    and `weight_max` (of the raw token weights w), `rollout_corr/changed_frac` (tokens truncated or masked)
    and `rollout_corr/seq_weight_mean` (of W, geometric per token: exp(mean log w) over each sequence)."""
    weights, changed = ROLLOUT_CORRECTIONS.get(mode)(old, rollout, mask, cap)
    on = mask.bool()
    raw = _token_log_weights(old, rollout, mask)
    tokens = mask.sum(-1).clamp(min=1)
    per_seq = (raw.sum(-1) / tokens).exp()[on.any(-1)]
    metrics = {
        "rollout_corr/weight_mean": raw[on].exp().mean().item() if on.any() else 1.0,
        "rollout_corr/weight_max": raw[on].exp().max().item() if on.any() else 1.0,
        "rollout_corr/changed_frac": changed[on].float().mean().item() if on.any() else 0.0,
        "rollout_corr/seq_weight_mean": per_seq.mean().item() if len(per_seq) else 1.0,
    }
    return advantages * weights, metrics
