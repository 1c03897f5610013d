"""Reward shaping and batch filtering around the estimators: DAPO's overlong penalty and dynamic sampling,
and the KL penalty in the reward with its fixed or adaptive coefficient. Pure functions over tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from components.algorithms.advantages import group_index
from components.algorithms.losses import kl_penalty


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) per response. lengths (B,) -> (B,) <= 0.

    0 while |y| <= max_len - buffer; then falls linearly to -factor at |y| = max_len:
    ((max_len - buffer) - |y|) / buffer * factor. buffer_len 0 turns it off.
    """
    if buffer_len <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer_len)).clamp(min=0)
    return -(over / buffer_len).clamp(max=1.0) * factor


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: True (B,) for rows whose group's scores are not all equal.

    A group whose completions all score the same has zero advantage under every group baseline and only
    dilutes the batch. scores (B,), group_ids (B,) -> bool (B,).
    """
    inverse, n = group_index(group_ids)
    lo = torch.full((n,), float("inf")).scatter_reduce(0, inverse, scores.float(), "amin")
    hi = torch.full((n,), float("-inf")).scatter_reduce(0, inverse, scores.float(), "amax")
    return (hi > lo)[inverse]


def kl_in_reward(
    token_rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str,
) -> tuple[torch.Tensor, float]:
    """r_t = score_t - coef * kl_t over response tokens (B, T); also the batch's mean per-token KL (the mean
    over sequences of each sequence's masked mean), which the adaptive controller tracks."""
    kl = kl_penalty(logp, ref_logp, kind) * mask
    per_seq = kl.sum(-1) / mask.sum(-1).clamp(min=1)
    return token_rewards - coef * kl, float(per_seq.mean()) if len(per_seq) else 0.0


@dataclass
class KLController:
    """The KL-in-reward coefficient. `fixed` keeps it; `adaptive` (Ziegler et al. 2019, arXiv 1909.08593)
    moves it toward a target KL: coef <- coef (1 + clip(KL / target - 1, +-0.2) n / horizon)."""

    value: float
    kind: str = "fixed"  # "fixed" | "adaptive"
    target: float = 0.1
    horizon: int = 10000

    def __post_init__(self) -> None:
        self.start = self.value

    def update(self, current_kl: float, n_steps: int) -> float:
        if self.kind == "adaptive":
            error = max(-0.2, min(0.2, current_kl / self.target - 1))
            self.value *= 1 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def group_counts(group_ids: torch.Tensor) -> int:
    """Number of distinct groups in (B,) ids."""
    return group_index(group_ids)[1]
