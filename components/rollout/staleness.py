"""Asynchronous RL's bookkeeping over batches (trainer.async_mode): how many policy versions each sample lags
the policy that trains on it, the samples too old to keep, and how long sampling ran beside the update.

Every sample carries the weights version that sampled it (`sample_version`, set by the rollout); the policy
that trains on a batch is at `policy_version`. Staleness = policy_version - sample_version: 0 in the
synchronous loop, exactly 1 for one_step_off (batch k+1 sampled with the weights from before update k),
up to trainer.max_staleness for bounded_staleness.
"""

from __future__ import annotations

import torch

from components.batch import Batch


def staleness(batch: Batch, policy_version: int) -> torch.Tensor:
    """(N,) policy versions each sample lags: policy_version - the version that sampled it."""
    return policy_version - batch.tensors["sample_version"]


def within_bound(batch: Batch, policy_version: int, max_staleness: int) -> tuple[Batch, int]:
    """The samples at most `max_staleness` versions behind, and how many were dropped. A group's samples come
    from one rollout, so one version: groups are kept or dropped whole.

    >>> b = Batch({"sample_version": torch.tensor([3, 3, 5, 5])})
    >>> kept, dropped = within_bound(b, 6, 2)
    >>> kept.tensors["sample_version"].tolist(), dropped
    ([5, 5], 2)
    """
    keep = staleness(batch, policy_version) <= max_staleness
    return batch.select(keep.nonzero().squeeze(-1)), int((~keep).sum())


def staleness_metrics(batch: Batch, policy_version: int, dropped: int) -> dict[str, float]:
    """async/staleness/{mean,max} over the samples kept, async/dropped_samples, and async/partial_samples:
    those sampled after an update landed mid-rollout (trainer.partial_rollouts)."""
    lag = staleness(batch, policy_version).float()
    partial = batch.tensors.get("partial_rollout")
    return {
        "async/staleness/mean": float(lag.mean()) if len(lag) else 0.0,
        "async/staleness/max": float(lag.max()) if len(lag) else 0.0,
        "async/dropped_samples": float(dropped),
        "async/partial_samples": float(partial.sum()) if partial is not None else 0.0,
    }


def overlap_seconds(windows: list[tuple[float, float]], span: tuple[float, float]) -> float:
    """Seconds of `span` (start, end) during which at least one of `windows` ran: how long sampling overlapped
    the update (timing_s/overlap).

    >>> overlap_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], (1.5, 5.5))
    2.0
    """
    merged: list[list[float]] = []
    for start, end in sorted(windows):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    lo, hi = span
    return sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in merged)
