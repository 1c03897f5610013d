"""A rollout as one Batch: rows x n completions from an engine's output, responses decoded back to text, and
several generation rounds (or engines' shares) joined."""

from __future__ import annotations

import torch

from components.batch import Batch
from components.rollout.base import RolloutOutput, left_pad


def rollout_batch(
    rows: list[dict], prompt_ids: list[list[int]], out: RolloutOutput, n: int, pad_id: int, iteration: int
) -> Batch:
    """Rows x n completions as one Batch. group_ids (N,) tie completions of one prompt together."""
    prompts, prompt_mask = left_pad(prompt_ids, pad_id)
    reps = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
    routes = {}
    if out.routes is not None:  # an MoE policy's experts, split where the batch splits prompt and response
        width = prompts.shape[1]
        routes = {"prompt_routes": out.routes[:, :width], "response_routes": out.routes[:, width:]}
    return Batch(
        tensors={
            **routes,
            "prompts": prompts.repeat_interleave(n, 0),
            "prompt_mask": prompt_mask.repeat_interleave(n, 0),
            "responses": out.responses,
            "response_mask": out.response_mask,
            "rollout_logprobs": out.logprobs,
            "group_ids": torch.arange(len(rows)).repeat_interleave(n),
            # the weights version that sampled each row: its staleness when it trains (async modes)
            "sample_version": torch.full((len(out.responses),), out.weights_version, dtype=torch.long),
        },
        non_tensors={
            "ground_truth": reps([r["reward_model"]["ground_truth"] for r in rows]),
            "data_source": reps([r["data_source"] for r in rows]),
            "extra_info": reps([dict(r["extra_info"]) for r in rows]),
            "sample_index": [j for _ in rows for j in range(n)],
        },
        meta={"iteration": iteration, "weights_version": out.weights_version, "n": n},
    )


def decode_responses(
    tokenizer,
    batch: Batch,
    key: str = "responses",
    mask_key: str = "response_mask",
    skip_special_tokens: bool = True,
) -> list[str]:
    t = batch.tensors
    ids = [row[m.bool()].tolist() for row, m in zip(t[key], t[mask_key])]
    return tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)


def _pad_width(t: torch.Tensor, width: int, left: bool) -> torch.Tensor:
    """(N, W, ...) -> (N, width, ...) with zeros: on the left for prompts (they end at the last column), else
    right. (An MoE route of 0 on padding is harmless: no real token attends to a padded position.)"""
    extra = width - t.shape[1]
    if extra <= 0:
        return t
    pad = torch.zeros((t.shape[0], extra, *t.shape[2:]), dtype=t.dtype)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


def concat_rounds(parts: list[Batch]) -> Batch:
    """Batches from several generation rounds as one: group ids renumbered so rounds never share a group, and
    token tensors (2-D, and MoE routes) padded to a common width (prompt tensors on the left, response
    tensors on the right; the masks are 0 on the padding, so no loss or reward sees it)."""
    parts = [p for p in parts if len(p)] or parts[:1]
    widths = {
        k: max(p.tensors[k].shape[1] for p in parts)
        for k, v in parts[0].tensors.items()
        if v.dim() == 2 or k.endswith("_routes")  # not images: (N, C, H, W) has no token axis
    }
    out, offset = [], 0
    for p in parts:
        ids = p.tensors["group_ids"]
        padded = {k: _pad_width(p.tensors[k], w, k.startswith("prompt")) for k, w in widths.items()}
        out.append(p.union(group_ids=ids + offset, **padded))
        offset += int(ids.max()) + 1 if len(ids) else 0
    return Batch.concat(out)
