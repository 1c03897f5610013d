"""The update loop the actor and the critic share: epochs over shuffled mini-batches, one optimizer step
per mini-batch, gradients accumulated over micro-batches.

Losses are aggregated with the counts of the whole (global) mini-batch (AggParams), so accumulating
micro-batch gradients gives the same step as one pass over the mini-batch, and N workers, each with 1/N of
every mini-batch, the same step as one worker: the counts are summed over the workers, and each worker's
loss is multiplied by N because DDP and FSDP average gradients.

Micro-batches are either a fixed number of rows (`micro_batch_size`) or packed to a token budget
(`max_tokens`: rows sorted by length, as many per micro-batch as fit); either way each is cut to its own
longest prompt and response, so padding columns no row needs are never computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from components.algorithms.losses import AggParams
from components.batch import Batch
from components.data.sampler import pack_by_tokens
from components.errors import TrainingDiverged
from components.settings import LoopSettings
from components.training.distributed import Comm, make_step
from components.training.logprobs import response_attention

# (micro-batch, counts of its mini-batch) -> (loss to backpropagate, additive metrics of 0-dim tensors)
MicroLoss = Callable[[Batch, AggParams], tuple[torch.Tensor, dict[str, torch.Tensor]]]

# tensors aligned with the response tokens (N, R): cut with the responses
TOKEN_KEYS = (
    "responses",
    "response_mask",
    "response_attention_mask",
    "rollout_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "advantages",
    "returns",
    "token_rewards",
    "values",
    "response_routes",
)


def row_lengths(b: Batch) -> torch.Tensor:
    """Tokens of each row (prompt + response), padding excluded."""
    t = b.tensors
    return t["prompt_mask"].sum(1) + response_attention(t).sum(1)


def balanced_shards(b: Batch, n: int) -> list[list[int]]:
    """Row indices for n workers: equal row counts (the first len % n workers one more), token counts
    balanced greedily, longest rows first, each to the worker with the fewest tokens that still has room."""
    lengths = row_lengths(b).tolist()
    room = [len(b) // n + (k < len(b) % n) for k in range(n)]
    shards: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(b)), key=lambda i: (-lengths[i], i)):
        w = min((k for k in range(n) if len(shards[k]) < room[k]), key=lambda k: (load[k], k))
        shards[w].append(i)
        load[w] += lengths[i]
    return [sorted(s) for s in shards]


def padded_tokens(b: Batch) -> int:
    """Tokens a forward pass over `b` computes: rows x (prompt columns + response columns)."""
    return len(b) * (b.tensors["prompts"].shape[1] + b.tensors["responses"].shape[1])


def trim_padding(b: Batch) -> Batch:
    """Drop prompt columns no row uses (left padding) and response columns past the longest response."""
    t = b.tensors
    p_used = t["prompt_mask"].any(0).nonzero()
    r_used = response_attention(t).any(0).nonzero()
    p0 = int(p_used[0]) if len(p_used) else t["prompts"].shape[1] - 1
    r1 = int(r_used[-1]) + 1 if len(r_used) else 1
    cut = {k: v[:, p0:] for k, v in t.items() if k in ("prompts", "prompt_mask", "prompt_routes")}
    cut |= {k: v[:, :r1] for k, v in t.items() if k in TOKEN_KEYS and v.dim() >= 2}
    return b.union(**cut)


def row_chunks(b: Batch, size: int | None) -> list[Batch]:
    """Consecutive parts of at most `size` rows (None = one part), padding kept (for outputs of shape (N, R))."""
    return b.chunk(max(1, -(-len(b) // (size or len(b)))))


def micro_batches(b: Batch, size: int | None, max_tokens: int | None = None) -> list[Batch]:
    """Micro-batches of `b`: packed to `max_tokens` when set, else consecutive parts of at most `size` rows
    (None = one part); each cut to its own padding."""
    if max_tokens:
        lengths = (b.tensors["prompts"].shape[1] + response_attention(b.tensors).sum(1)).tolist()
        return [trim_padding(b.select(idx)) for idx in pack_by_tokens(lengths, max_tokens)]
    return [trim_padding(p) for p in row_chunks(b, size)]


def minibatch_update(
    batch: Batch,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    s: LoopSettings,
    step: int,
    micro_loss: MicroLoss,
    prefix: str,
    comm: Comm | None = None,
    scaler: torch.amp.GradScaler | None = None,
    pipeline=None,
    logits_loss=None,
) -> dict[str, float]:
    """Run s.ppo_epochs passes over the (whole) `batch`; returns each metric averaged over optimizer steps
    (summed over workers), with `{prefix}/grad_norm` (before clipping) and `{prefix}/lr`. The shuffle is
    seeded by (seed, step), the same on every worker; of each mini-batch a worker takes its token-balanced
    share (balanced_shards), so N workers make exactly the steps one worker makes."""
    comm = comm or Comm()
    # a pipeline stage: the schedule runs forward and backward, the last stage logits_loss on its logits
    opt = make_step(model, optimizer, s.grad_clip, scaler, pipeline, logits_loss)
    mini_size = s.mini_batch_size or len(batch)
    gen = torch.Generator().manual_seed(s.seed + step)
    sums: dict[str, float] = {}
    grad_norms, lrs = [], []
    for _ in range(s.ppo_epochs):
        order = (
            torch.randperm(len(batch), generator=gen) if mini_size < len(batch) else torch.arange(len(batch))
        )
        for start in range(0, len(batch), mini_size):
            mini = batch.select(order[start : start + mini_size])
            if comm.world_size > 1:
                mini = mini.select(balanced_shards(mini, comm.world_size)[comm.rank])
            tokens, rows = comm.sum([float(mini.tensors["response_mask"].sum()), float(len(mini))])
            agg = AggParams(max(tokens, 1.0), rows, s.norm_const)
            parts = micro_batches(mini, s.micro_batch_size, s.max_tokens)
            # every worker must run as many backward passes (each reduces gradients): pad with zero-weight ones
            n_passes = comm.max(len(parts))
            opt.zero_grad()
            for i in range(n_passes):
                last = i == n_passes - 1
                scale = comm.world_size if i < len(parts) else 0.0
                metrics = opt.forward_backward(micro_loss, parts[min(i, len(parts) - 1)], agg, scale, last)
                if i < len(parts):
                    for k, v in metrics.items():  # every metric is additive across micro-batches and workers
                        sums[k] = sums.get(k, 0.0) + float(v)
            lrs.append(scheduler.get_last_lr()[0])
            grad_norms.append(opt.step())
            scheduler.step()
    n_steps = len(grad_norms)
    keys = sorted(sums)
    out = {k: v / n_steps for k, v in zip(keys, comm.sum([sums[k] for k in keys]))}
    out[f"{prefix}/grad_norm"] = sum(grad_norms) / n_steps
    out[f"{prefix}/lr"] = sum(lrs) / n_steps
    # with fp16's loss scaling an infinite gradient is routine (the scaler skips that step)
    watched = {k: v for k, v in out.items() if k.endswith("loss") or (k.endswith("grad_norm") and not scaler)}
    if pipeline is None:  # a pipeline's stages hold no whole model to run a row through
        watched[f"{prefix}/loss_after_step"] = loss_after_step(batch, micro_loss, s.norm_const)
    iteration = batch.meta.get("iteration", step + 1)
    check_finite(watched, model, comm, prefix, iteration, out[f"{prefix}/lr"])
    return out


def loss_after_step(batch: Batch, micro_loss: MicroLoss, norm_const) -> float:
    """The loss of the batch's first row at the weights the update left. A step too large can leave finite
    weights whose forward is already NaN (lr=1e20 on the tiny model); this shows it before the weights reach
    the engine or a checkpoint. One row, no gradient: a small fraction of the update's cost."""
    row = trim_padding(batch.select([0]))
    agg = AggParams(max(float(row.tensors["response_mask"].sum()), 1.0), 1.0, norm_const)
    with torch.no_grad():
        loss, _ = micro_loss(row, agg)
    return float(loss)


def non_finite_weights(model: torch.nn.Module) -> list[str]:
    """Names of the parameters of this worker (its shard, for sharded ones) holding a NaN or an infinity."""
    names = []
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor's shard on this rank
        if local.numel() and not bool(torch.isfinite(local.detach()).all()):
            names.append(name)
    return names


def check_finite(
    metrics: dict[str, float], model: torch.nn.Module, comm: Comm, prefix: str, iteration: int, lr: float
) -> None:
    """Stop the run when this update made its loss, gradient norm or weights non-finite: every worker
    checks its own share and all of them agree (so none waits in a collective for one that raised). Raised
    before the weights reach the engine or a checkpoint, so the last good checkpoint stays `latest`."""
    bad_metrics = [f"{k}={v}" for k, v in metrics.items() if not math.isfinite(v)]
    bad_weights = non_finite_weights(model)
    if not comm.max(int(bool(bad_metrics or bad_weights))):
        return
    if bad_metrics:
        what = ", ".join(bad_metrics)
    elif bad_weights:
        what = f"{len(bad_weights)} weight tensors non-finite (first {bad_weights[0]})"
    else:
        what = "another worker's weights non-finite"
    raise TrainingDiverged(
        f"iteration {iteration}: the {prefix} update diverged ({what}); the step size is the likely cause: "
        f"lower {prefix}.optimizer.lr (now {lr:g}) or "
        f"{prefix}.optimizer.grad_clip. Nothing of this iteration was checkpointed or registered; the last "
        "good checkpoint stays `latest`, and a resumed run starts from it."
    )
