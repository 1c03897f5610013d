"""The update loop the actor and the critic share: epochs over shuffled mini-batches, one optimizer step
per mini-batch, gradients accumulated over micro-batches.

Losses are aggregated with the counts of the whole mini-batch (AggParams), so accumulating micro-batch
gradients gives the same step as one pass over the mini-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from components.algorithms.losses import AggParams
from components.batch import Batch

# (micro-batch, counts of its mini-batch) -> (loss to backpropagate, additive metrics of 0-dim tensors)
MicroLoss = Callable[[Batch, AggParams], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class LoopSettings:
    ppo_epochs: int = 1
    mini_batch_size: int | None = None  # None = the whole batch
    micro_batch_size: int | None = None  # None = the whole mini-batch
    grad_clip: float = 1.0
    norm_const: float = 1.0  # seq-mean-token-sum-norm constant (max response length)
    seed: int = 0


def micro_batches(b: Batch, size: int | None) -> list[Batch]:
    """Consecutive parts of at most `size` rows (None = one part)."""
    size = size or len(b)
    return b.chunk(max(1, -(-len(b) // size)))


def minibatch_update(batch: Batch, model: torch.nn.Module, optimizer, scheduler, s: LoopSettings, step: int,
                     micro_loss: MicroLoss, prefix: str) -> dict[str, float]:
    """Run s.ppo_epochs passes over `batch`; returns each metric averaged over optimizer steps, with
    `{prefix}/grad_norm` (before clipping) and `{prefix}/lr`. The shuffle is seeded by (seed, step)."""
    mini_size = s.mini_batch_size or len(batch)
    gen = torch.Generator().manual_seed(s.seed + step)
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    n_steps = 0
    for _ in range(s.ppo_epochs):
        order = torch.randperm(len(batch), generator=gen) if mini_size < len(batch) else torch.arange(len(batch))
        for start in range(0, len(batch), mini_size):
            mini = batch.select(order[start:start + mini_size])
            mask = mini.tensors["response_mask"]
            agg = AggParams(float(mask.sum().clamp(min=1)), float(len(mini)), s.norm_const)
            optimizer.zero_grad(set_to_none=True)
            for mb in micro_batches(mini, s.micro_batch_size):
                loss, metrics = micro_loss(mb, agg)
                loss.backward()
                for k, v in metrics.items():  # every metric is additive across micro-batches
                    sums[k] = sums.get(k, 0.0) + float(v)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
            sums[f"{prefix}/grad_norm"] = sums.get(f"{prefix}/grad_norm", 0.0) + float(grad_norm)
            sums[f"{prefix}/lr"] = sums.get(f"{prefix}/lr", 0.0) + scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            n_steps += 1
    return {k: v / n_steps for k, v in sums.items()}
