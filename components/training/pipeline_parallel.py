"""Pipeline parallelism (actor.pipeline_model_parallel_size): a Hugging Face causal LM of the Llama family cut
into contiguous stages of decoder layers, one worker each. Every stage is the model itself with the parts it
does not own replaced by pass-throughs, so parameter names stay those of the whole model (full state dicts and
checkpoints need no renaming) and transformers' own forward (masks, rotary embeddings) runs on every stage.
torch.distributed.pipelining's schedules (GPipe, 1F1B) drive the stages over
actor.pipeline_microbatches micro-batches of each update micro-batch.

The update: the batch's response tensors reach every stage as the schedule's chunked kwargs, the last stage
turns its logits into the PPO micro-loss (in the mini-batch's global counts, so scale_grads=False) and its
metrics, which are broadcast to the other stages; a tied embedding (first stage) and head (last stage) are one
parameter whose two gradients are summed before the step; the gradient norm is the whole model's. Old
log-probs go through the forward-only schedule. Full weights and full checkpoints are gathered on rank 0 in the
one-worker format (the optimizer numbered in the whole model's parameter order), so a pipeline's checkpoint
resumes in one worker and back.

With data and tensor parallelism the workers form a (dp, pp, tp) mesh: each data-parallel replica is a
pipeline (gradients averaged across the pipelines, as DDP), each stage split over its TP workers.

This version runs without a critic, sequence parallelism, sharded checkpoints, autocast or a VLM: the config
check refuses each (components/config/checks.py).
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


def _schedules():
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class StageModule(nn.Module):
    """One pipeline stage: token ids in (first stage) or hidden states in, hidden states or (last stage)
    logits out. attention_mask and position_ids reach every stage (the schedule's kwargs), and so do the
    batch tensors a last-stage `head` turns the logits into (a micro-batch's loss, or its log-probs)."""

    def __init__(self, lm: nn.Module, first: bool, last: bool = False):
        super().__init__()
        self.lm, self.first, self.last = lm, first, last
        self.head = None  # (logits, batch tensors) -> what the last stage returns

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, **tensors):
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        out = self.lm(
            **inputs, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits
        return self.head(out, tensors) if self.last and self.head is not None else out


class Pipeline:
    """This worker's stage of a pipeline-parallel policy, and what the update needs of it: a forward-backward
    of a micro-batch through the schedule, a forward-only pass, gradients averaged over the data-parallel
    replicas and a tied embedding's summed across its two stages, the global gradient norm, and full state
    dicts gathered on rank 0 in the one-worker format.

    `mesh` is the group's (dp, pp, tp) device mesh (components/training/distributed.parallel_mesh): each
    data-parallel replica is one pipeline of pp stages, each stage split over tp workers (DTensor, the plan
    of components/training/tensor_parallel.py). Activations pass between the stages' TP peers of the same
    index, whole: a stage's output is replicated over its TP workers."""

    def __init__(self, lm: nn.Module, mesh, microbatches: int, schedule: str):
        import torch.distributed as dist

        self.mesh = mesh
        self.stage, self.stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
        self.group = mesh["pp"].get_group()  # this pipeline's stages (same dp and tp index)
        self.last_rank = dist.get_global_rank(self.group, self.stages - 1)
        self.dp_group = mesh["dp"].get_group() if mesh["dp"].size() > 1 else None
        # the one worker that answers for the whole group: the first pipeline's TP rank 0 of each stage
        self.writer = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
        self.microbatches, self.schedule = microbatches, schedule
        self.full_names = [n for n, p in lm.named_parameters() if p.requires_grad]  # the one-worker order
        self.tied = lm.get_output_embeddings() is not None and (
            lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
        )
        self.tied_group = self._tied_group() if self.tied else None
        self.module = StageModule(
            prune_to_stage(lm, self.stages, self.stage), self.stage == 0, self.stage == self.stages - 1
        )
        if mesh["tp"].size() > 1:
            from components.training.tensor_parallel import parallelize

            parallelize(self.module.lm, mesh["tp"])

    def _tied_group(self):
        """The group of the first and the last stage of this worker's pipeline and TP index (new_group is
        collective: every rank makes every such group, in the same order)."""
        import torch.distributed as dist

        ranks = self.mesh.mesh  # (dp, pp, tp) global ranks
        mine = None
        for d in range(ranks.shape[0]):
            for t in range(ranks.shape[2]):
                pair = [int(ranks[d, 0, t]), int(ranks[d, -1, t])]
                group = dist.new_group(pair)
                if dist.get_rank() in pair:
                    mine = group
        return mine

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def _run(self, t: dict[str, torch.Tensor], head, with_backward: bool):
        from torch.distributed.pipelining import PipelineStage

        from components.training.logprobs import response_attention, sequence_inputs

        ids, mask, pos = sequence_inputs(
            t["prompts"], t["prompt_mask"], t["responses"], response_attention(t)
        )
        n = min(self.microbatches, len(ids))
        kind = self.schedule if n >= self.stages else "gpipe"  # 1F1B needs a micro-batch per stage at least
        self.module.head = head
        stage = PipelineStage(self.module, self.stage, self.stages, ids.device, group=self.group)
        loss_fn = (lambda out, target: out) if with_backward else None
        sched = _schedules()[kind](stage, n_microbatches=n, loss_fn=loss_fn, scale_grads=False)
        tensors = {k: v for k, v in t.items() if v.dim() >= 1 and len(v) == len(ids)}
        kwargs = {"attention_mask": mask, "position_ids": pos, **tensors}
        args = (ids,) if self.stage == 0 else ()
        target = torch.zeros(len(ids)) if with_backward and self.is_last else None
        try:
            if with_backward:
                sched.step(*args, target=target, return_outputs=False, **kwargs)
                return n
            return sched.eval(*args, **kwargs)
        finally:
            self.module.head = None

    def forward_backward(self, t: dict[str, torch.Tensor], loss) -> dict[str, float]:
        """Forward and backward of one micro-batch through the schedule; `loss(logits, tensors)` -> (loss,
        metrics) runs on the last stage for each of the schedule's micro-batches (summed: the loss is in
        the mini-batch's global counts). Returns the last stage's summed metrics ({} on other stages)."""
        calls: list[dict] = []

        def head(logits, tensors):
            value, m = loss(logits, tensors)
            calls.append({k: float(v) for k, v in m.items()})
            return value

        n = self._run(t, head, with_backward=True)
        # a new schedule first infers the stage's shapes with one forward over placeholder inputs: not a sample
        metrics: dict[str, float] = {}
        for m in calls[len(calls) - n :] if self.is_last else []:
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v
        return metrics

    def forward_only(self, t: dict[str, torch.Tensor], head) -> torch.Tensor:
        """`head(logits, tensors)` (rows, R) of every row, computed on the last stage and sent to all."""
        import torch.distributed as dist

        with torch.no_grad():
            out = self._run(t, head, with_backward=False)
        shape = [len(t["responses"]), t["responses"].shape[1]]
        result = out.float() if self.is_last else torch.zeros(shape)
        dist.broadcast(result, src=self.last_rank, group=self.group)
        return result

    def from_last_stage(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last stage's metrics on every stage (the group answers rank 0's)."""
        import torch.distributed as dist

        box = [metrics]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return {**metrics, **box[0]}

    def _tied_param(self) -> torch.nn.Parameter | None:
        if not self.tied:
            return None
        lm = self.module.lm
        if self.stage == 0:
            return lm.get_input_embeddings().weight
        return lm.lm_head.weight if self.is_last else None

    def sync_grads(self) -> None:
        """Average the gradients over the data-parallel replicas (each loss was multiplied by their number, so
        this is their sum in the global counts, as DDP's); then a tied embedding, one parameter held by the
        first and the last stage, gets the sum of its two gradients."""
        import torch.distributed as dist

        if self.dp_group is not None:
            replicas = dist.get_world_size(self.dp_group)
            for p in self.module.parameters():
                if p.requires_grad:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    g = _local(p.grad)
                    dist.all_reduce(g, group=self.dp_group)
                    g.div_(replicas)
        p = self._tied_param()
        if p is not None and self.stages > 1:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(_local(p.grad), group=self.tied_group)

    def clip_grad_norm(self, max_norm: float) -> float:
        """The whole model's gradient norm (the tied weight counted once), every stage scaled by one factor."""
        import torch.distributed as dist

        from components.training.tensor_parallel import scale_to_norm, squared_norm

        tied = self._tied_param() if self.is_last and self.stage != 0 else None
        with_grads = [p for p in self.module.parameters() if p.grad is not None]
        squares = torch.tensor(
            squared_norm([p.grad for p in with_grads if p is not tied]), dtype=torch.float64
        )
        dist.all_reduce(squares, group=self.group)  # the stages' (each already whole over its TP workers)
        total = float(squares) ** 0.5
        scale_to_norm([p.grad for p in with_grads], total, max_norm)
        return total

    def _gather(self, own: dict) -> dict:
        """The writers' dicts merged on rank 0 ({} elsewhere); every rank must call it."""
        import torch.distributed as dist

        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(own if self.writer else {}, parts, dst=0)
        return {k: v for part in parts for k, v in part.items()} if dist.get_rank() == 0 else {}

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on rank 0 (CPU), {} elsewhere; every stage must call it."""
        state = self.module.lm.state_dict() if self.mesh["dp"].get_local_rank() == 0 else {}
        return self._gather({k: _whole(v).detach().cpu().clone() for k, v in state.items()})

    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        own = self.module.lm.state_dict()
        self.module.lm.load_state_dict({k: _like(state[k], v) for k, v in own.items()})

    def _named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.module.lm.named_parameters())

    def full_optimizer_state(self, optimizer) -> dict:
        """The optimizer state in torch's plain format numbered in the whole model's parameter order (as one
        worker saves it) on rank 0, {} elsewhere; a tied head's state (equal to the embedding's) is dropped."""
        own = {}
        if self.mesh["dp"].get_local_rank() == 0:  # the first pipeline's: the replicas' are equal
            for n, p in self._named_params():
                if p in optimizer.state:
                    own[n] = {
                        k: _whole(v).detach().cpu().clone() if torch.is_tensor(v) else v
                        for k, v in optimizer.state[p].items()
                    }
        named = self._gather(own)
        if not named:
            return {}
        index = {n: i for i, n in enumerate(self.full_names)}
        group = {k: v for k, v in optimizer.state_dict()["param_groups"][0].items() if k != "params"}
        return {
            "state": {index[n]: s for n, s in named.items() if n in index},
            "param_groups": [{**group, "params": list(range(len(self.full_names)))}],
        }

    def load_full_optimizer_state(self, optimizer, state: dict) -> None:
        params = [(n, p) for n, p in self._named_params() if p.requires_grad]
        index = {n: i for i, n in enumerate(self.full_names)}
        alias = {"lm_head.weight": "model.embed_tokens.weight"} if self.tied else {}
        saved = {int(k): v for k, v in state["state"].items()}
        own = {}
        for i, (n, p) in enumerate(params):
            j = index.get(n, index.get(alias.get(n, "")))
            if j is not None and j in saved:
                own[i] = {
                    k: _like(v, p) if torch.is_tensor(v) and v.dim() else v for k, v in saved[j].items()
                }
        group = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
        optimizer.load_state_dict(
            {"state": own, "param_groups": [{**group, "params": list(range(len(params)))}]}
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """This worker's part of a (DTensor) tensor, for collectives over other groups than its mesh's."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (DTensor) tensor: gathered over its TP workers (collective for them)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _like(whole: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`whole` laid out as `target` is: split over its TP workers when `target` is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        return distribute_tensor(whole.to(target.dtype), target.device_mesh, target.placements)
    return whole
