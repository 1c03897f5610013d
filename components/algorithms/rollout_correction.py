"""Off-policy correction between the rollout engine and the trainer (algorithm.rollout_correction): the
samples were drawn by the engine's distribution (vLLM's kernels, bf16, an older policy version when rollout
runs ahead), while the update's importance ratio is taken against the trainer's old log-probs. Each token's
importance weight w = pi_old / pi_rollout = exp(old_logprobs - rollout_logprobs) corrects for it:

- `tis`: token-level truncated IS, the loss of each token weighted by min(w, cap);
- `mis`: token-level masked IS, tokens with w outside [1/cap, cap] get weight 0, the others 1;
- `seq_tis`: the sequence's weight W = prod_t w_t (over its response tokens), truncated at cap, for every
  token of the sequence;
- `seq_mis`: sequences with W outside [1/cap, cap] get weight 0, the others 1;
- `geo_mis`: geometric-mean sequence masking, sequences whose exp(mean_t log w_t) lies outside
  [geo_low, geo_high] get weight 0: unlike W it does not grow with the length, so one band fits every length;
- `icepop`: IcePop's token band (the Ring-1T report): tokens with w outside [band_low, band_high]
  get weight 0 (a band of its own, asymmetric, where `mis` is symmetric about 1);
- `offpolicy_mask`: DeepSeek-V3.2's off-policy sequence mask (its technical report): a sequence with a negative
  advantage whose divergence mean_t (log pi_rollout - log pi_old) passes `offpolicy_threshold` gets weight
  0. Positive sequences are kept however far they drifted: learning from one's own good samples is safe,
  pushing down a token the trainer barely produces is what destabilises. Here pi_old is the trainer's
  policy before the update (the paper's is the current one, mini-batch by mini-batch).

Modes combine with `+` (`tis+icepop`): their weights multiply. Every function here has one signature:
(old_logprobs (N, R), rollout_logprobs (N, R), mask (N, R), advantages (N, R), CorrectionParams) ->
weights (N, R), detached and 0 off the mask, and `changed` (N, R) bool, the tokens whose weight the mode
moved (truncated or masked). The weights multiply the advantages (the clipped PPO loss is linear in them for
a positive weight), so every policy loss and aggregation mode takes them unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from components.algorithms.registry import Registry

# mode -> (old, rollout, mask, advantages, params) -> (weights, changed)
ROLLOUT_CORRECTIONS: Registry = Registry("rollout correction", "algorithm.rollout_correction.mode")


@dataclass(frozen=True)
class CorrectionParams:
    cap: float = 2.0  # tis / seq_tis truncation; mis / seq_mis band [1/cap, cap]
    band_low: float = 0.5  # icepop: the token band (IcePop's alpha, beta)
    band_high: float = 5.0
    geo_low: float = 0.999  # geo_mis: the band of the per-token geometric mean weight
    geo_high: float = 1.001
    offpolicy_threshold: float = 1e-4  # offpolicy_mask: mean log(pi_rollout / pi_old) over the sequence


def _token_log_weights(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (old - rollout).detach() * mask


def _sequence_log_weights(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log W of each sequence, broadcast over its tokens (N, R)."""
    return _token_log_weights(old, rollout, mask).sum(-1, keepdim=True).expand_as(mask)


def _mean_log_weights(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean_t log w_t of each sequence (the log of its geometric-mean weight), broadcast (N, R)."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    return (_sequence_log_weights(old, rollout, mask) / lengths).expand_as(mask)


def _truncated(log_w: torch.Tensor, mask: torch.Tensor, cap: float):
    """min(w, cap) where log w is `log_w` (N, R); changed where the cap bit."""
    return log_w.exp().clamp(max=cap) * mask, (log_w > math.log(cap)) & mask.bool()


def _outside(log_w: torch.Tensor, mask: torch.Tensor, low: float, high: float):
    """1 where w lies in [low, high], 0 elsewhere; changed where it is 0."""
    out = ((log_w < math.log(low)) | (log_w > math.log(high))) & mask.bool()
    return (~out).float() * mask, out


@ROLLOUT_CORRECTIONS.register("tis")
def token_truncated(old, rollout, mask, advantages, p: CorrectionParams):
    """min(w_t, cap) on each token.

    >>> ones = torch.ones(1, 2)
    >>> w, c = token_truncated(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), ones, ones, CorrectionParams())
    >>> w.tolist(), c.tolist()
    ([[1.0, 2.0]], [[False, True]])
    """
    return _truncated(_token_log_weights(old, rollout, mask), mask, p.cap)


@ROLLOUT_CORRECTIONS.register("mis")
def token_masked(old, rollout, mask, advantages, p: CorrectionParams):
    """1 where w_t lies in [1/cap, cap], 0 elsewhere."""
    return _outside(_token_log_weights(old, rollout, mask), mask, 1 / p.cap, p.cap)


@ROLLOUT_CORRECTIONS.register("seq_tis")
def sequence_truncated(old, rollout, mask, advantages, p: CorrectionParams):
    """min(W, cap), W the product of the sequence's token weights, on each of its tokens."""
    return _truncated(_sequence_log_weights(old, rollout, mask), mask, p.cap)


@ROLLOUT_CORRECTIONS.register("seq_mis")
def sequence_masked(old, rollout, mask, advantages, p: CorrectionParams):
    """1 on the tokens of sequences whose W lies in [1/cap, cap], 0 on the others."""
    return _outside(_sequence_log_weights(old, rollout, mask), mask, 1 / p.cap, p.cap)


@ROLLOUT_CORRECTIONS.register("geo_mis")
def geometric_masked(old, rollout, mask, advantages, p: CorrectionParams):
    """1 on the tokens of sequences whose exp(mean_t log w_t) lies in [geo_low, geo_high], 0 elsewhere."""
    return _outside(_mean_log_weights(old, rollout, mask), mask, p.geo_low, p.geo_high)


@ROLLOUT_CORRECTIONS.register("icepop")
def icepop(old, rollout, mask, advantages, p: CorrectionParams):
    """1 where w_t lies in [band_low, band_high], 0 elsewhere (the token's gradient is dropped)."""
    return _outside(_token_log_weights(old, rollout, mask), mask, p.band_low, p.band_high)


@ROLLOUT_CORRECTIONS.register("offpolicy_mask")
def offpolicy_sequence_mask(old, rollout, mask, advantages, p: CorrectionParams):
    """0 on sequences with a negative advantage and mean_t (log pi_rollout - log pi_old) > threshold."""
    divergence = -_mean_log_weights(old, rollout, mask)
    negative = ((advantages * mask).sum(-1, keepdim=True) < 0).expand_as(mask)
    out = negative & (divergence > p.offpolicy_threshold) & mask.bool()
    return (~out).float() * mask, out


def check_mode(mode: str) -> list[str]:
    """The parts of a `+`-joined mode; KeyError naming the key and the valid modes on an unknown part."""
    parts = mode.split("+")
    for part in parts:
        ROLLOUT_CORRECTIONS.get(part)
    return parts


def correct_advantages(
    advantages: torch.Tensor,
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    params: CorrectionParams,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantages (N, R) weighted by the correction `mode` (parts joined by `+` multiply), and its
    metrics: `rollout_corr/weight_mean` and `weight_max` (of the raw token weights w),
    `rollout_corr/changed_frac` (tokens any part truncated or masked), `rollout_corr/<part>_frac` (each
    part's), `rollout_corr/seq_weight_mean` (of W, geometric per token: exp(mean log w) over each sequence)
    and `rollout_corr/seq_masked_frac` (sequences left with no weight at all)."""
    weights, changed = torch.ones_like(mask), torch.zeros_like(mask, dtype=torch.bool)
    on = mask.bool()
    metrics: dict[str, float] = {}
    for part in check_mode(mode):
        w, c = ROLLOUT_CORRECTIONS.get(part)(old, rollout, mask, advantages, params)
        weights, changed = weights * w, changed | c
        metrics[f"rollout_corr/{part}_frac"] = c[on].float().mean().item() if on.any() else 0.0
    raw = _token_log_weights(old, rollout, mask)
    rows = on.any(-1)
    per_seq = _mean_log_weights(old, rollout, mask)[:, 0].exp()[rows]
    dropped = ((weights * mask).sum(-1) == 0)[rows]
    metrics |= {
        "rollout_corr/weight_mean": raw[on].exp().mean().item() if on.any() else 1.0,
        "rollout_corr/weight_max": raw[on].exp().max().item() if on.any() else 1.0,
        "rollout_corr/changed_frac": changed[on].float().mean().item() if on.any() else 0.0,
        "rollout_corr/seq_weight_mean": per_seq.mean().item() if len(per_seq) else 1.0,
        "rollout_corr/seq_masked_frac": dropped.float().mean().item() if len(dropped) else 0.0,
    }
    return advantages * weights, metrics
