"""Pipeline parallelism (work in progress, not wired into the worker yet): a Hugging Face causal LM of the
Llama family cut into contiguous stages of decoder layers, each stage the model itself with the parts it does
not own replaced by pass-throughs, so parameter names stay those of the whole model (checkpoints and the
full state dict need no renaming) and transformers' own forward (masks, rotary embeddings) runs on every
stage. torch.distributed.pipelining's schedules (GPipe, 1F1B) drive the stages.

Shown so far (tests/components/training/test_pipeline_parallel.py): two stages under GPipe give the whole
model's logits exactly and its gradients within 1e-6, a tied embedding's gradient being the sum of the first
stage's (embedding) and the last stage's (head).

Still to do before actor.pipeline_model_parallel_size can be offered:
- the update: the last stage's forward computes the PPO micro-loss from its logits (the batch's response
  tensors reach every stage as chunked schedule kwargs; the loss uses the mini-batch's global counts, so
  scale_grads=False), its metrics broadcast from the last stage to rank 0; a schedule per micro-batch size;
- the tied embedding: its gradient all-reduced between the first and last stage before the step;
- gradient clipping: squares summed over the pipeline group (the tied weight once);
- prepare (old / reference log-probs) with the forward-only schedule, the result from the last stage;
- full weights for the engine and full checkpoints: every stage's keys gathered on rank 0; loading takes
  each stage's subset; the optimizer's plain (numbered) format built from parameter names;
- config: pipeline_model_parallel_size, pipeline_microbatches, pipeline_schedule (gpipe | 1f1b), checks (more
  stages than layers, the product of the mesh), the (dp, pp, tp) mesh, and the PP2, PP2 x TP2 equivalences.
"""

from __future__ import annotations

import torch
from torch import nn


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The decoder layers of `stage`: contiguous, the first num_layers % stages stages one more.

    >>> [list(stage_layers(5, 2, s)) for s in range(2)]
    [[0, 1, 2], [3, 4]]
    """
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class PassThrough(nn.Module):
    """A decoder layer this stage does not own: the hidden states go through unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def prune_to_stage(lm: nn.Module, stages: int, stage: int) -> nn.Module:
    """Keep in `lm` (in place) only what `stage` of `stages` computes: its decoder layers, the embedding on
    the first stage, the final norm and the head on the last."""
    base = lm.model
    n = len(base.layers)
    own = set(stage_layers(n, stages, stage))
    for i in range(n):
        if i not in own:
            base.layers[i] = PassThrough()
    if stage > 0:
        base.embed_tokens = None
    if stage < stages - 1:
        base.norm = nn.Identity()
        lm.lm_head = nn.Identity()
    return lm


class StageModule(nn.Module):
    """One pipeline stage: token ids in (first stage) or hidden states in, hidden states or (last stage)
    logits out. attention_mask and position_ids reach every stage (the schedule's kwargs)."""

    def __init__(self, lm: nn.Module, first: bool):
        super().__init__()
        self.lm, self.first = lm, first

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        return self.lm(
            **inputs, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits
