"""Tensor parallelism (actor.tensor_model_parallel_size): each decoder layer's matmuls split across the TP
workers of a data-parallel replica with PyTorch's DTensor (`parallelize_module`), by the plan transformers
itself declares for the architecture (`config.base_model_tp_plan`: Llama, Qwen2, Mistral, ...): q/k/v and
gate/up column-wise, o and down row-wise. The embedding and the LM head are split over the vocabulary when
the TP size divides it (a tied head stays tied: both hold the same Shard(0) DTensor). Norms stay whole on
every TP worker: with replicated activations between blocks their gradients come out equal on each.

Sequence parallelism (actor.sequence_parallel, Megatron's name): between the blocks the activations are
split over the sequence instead of replicated, so the norms and the residual stream (what a layer saves for
backward outside its matmuls) take 1/TP of the memory on each worker. The row-wise o/down projections
reduce-scatter over the sequence instead of all-reducing, each block all-gathers the sequence before its
column-wise matmuls (the same bytes on the wire as TP's all-reduce), the norms run on their sequence shard
(torch's SequenceParallel: their weight gradients are summed over the TP workers), and the sequence is
gathered again before the final norm, so the head, the loss and a critic's value head see whole tensors.

The same code runs with gloo on CPU and NCCL on GPUs: only the device mesh's device type differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _styles():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        # the head's vocabulary shards gathered, so the loss sees whole logits
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        # the embedding's vocabulary shards: each worker looks up its rows, the partial sums are all-reduced
        "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    }


# decoders whose layers are exactly input_layernorm -> self_attn -> post_attention_layernorm -> mlp between
# two residual adds, with a final `norm`: the layout sequence parallelism's plan is written for
SEQUENCE_PARALLEL_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _sequence_parallel_plan(at: str, embed: str, split_embedding: bool) -> dict[str, object]:
    """The styles sequence parallelism adds to (or puts in place of) the declared plan, under the base
    model's path `at` (`embed`: the input embedding's): activations Shard(1) (the sequence) between the
    blocks, whole inside them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq, whole = Shard(1), Replicate()
    if split_embedding:  # the vocabulary shards' partial sums reduce-scattered over the sequence
        lookup = RowwiseParallel(input_layouts=whole, output_layouts=seq, use_local_output=False)
    else:  # each worker keeps its sequence shard of the whole embedding's output
        lookup = PrepareModuleOutput(output_layouts=whole, desired_output_layouts=seq, use_local_output=False)
    layer = f"{at}layers.*."
    return {
        embed: lookup,
        layer + "input_layernorm": SequenceParallel(),
        layer + "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq}, desired_input_kwarg_layouts={"hidden_states": whole}
        ),
        layer + "post_attention_layernorm": SequenceParallel(),
        layer + "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
        f"{at}norm": PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(whole,), use_local_output=True
        ),
    }


def declared_plan(config) -> dict[str, str]:
    """The architecture's TP plan as transformers declares it for the base model ({} when it has none)."""
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def plan_problems(
    model_dir: str, tp: int, key: str = "actor.model.path", sequence_parallel: bool = False
) -> list[str]:
    """Why the model in `model_dir` cannot be split over `tp` workers (with sequence parallelism), each
    naming the key and the fix; [] when it can (or when the directory does not exist yet: the worker checks
    again when it loads it)."""
    if tp == 1 or not (Path(model_dir) / "config.json").is_file():
        return []
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if "vision_config" in raw:
        return [
            f"actor.tensor_model_parallel_size={tp} with the vision-language model in {key}={model_dir}: "
            "tensor parallelism splits text decoders only in this version; set it to 1."
        ]
    from transformers import AutoConfig

    # the plan of an architecture transformers has: a directory's own code is never run for it
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    text = config.get_text_config()
    if not declared_plan(text):
        return [
            f"actor.tensor_model_parallel_size={tp}: {key}={model_dir} is a {text.model_type} model, which has "
            "no tensor-parallel plan (the Llama family has one: Llama, Qwen2, Mistral); set it to 1."
        ]
    problems = []
    if sequence_parallel and text.model_type not in SEQUENCE_PARALLEL_MODEL_TYPES:
        problems.append(
            f"actor.sequence_parallel=true: {key}={model_dir} is a {text.model_type} model; its sequence-parallel "
            f"layout is written for {', '.join(SEQUENCE_PARALLEL_MODEL_TYPES)}; set actor.sequence_parallel=false."
        )
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    for name, count in (("attention heads", heads), ("key/value heads", kv)):
        if count % tp:
            problems.append(
                f"actor.tensor_model_parallel_size={tp} must divide the model's {count} {name} ({key}="
                f"{model_dir}); use a divisor of {count}."
            )
    size = getattr(text, "intermediate_size", None)
    if size and size % tp:
        problems.append(
            f"actor.tensor_model_parallel_size={tp} must divide the model's intermediate_size={size} ({key}="
            f"{model_dir}); use a divisor of it."
        )
    return problems


def _fqn(root: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, m in root.named_modules() if m is module)


def module_plan(root: torch.nn.Module, tp: int, sequence_parallel: bool = False) -> dict[str, object]:
    """{module path pattern: ParallelStyle} for the causal LM inside `root` (the policy itself, or a critic's
    backbone): the base model's declared plan under its path, then the input embedding and the LM head split
    over the vocabulary when `tp` divides it (else they stay whole on every worker: a vocabulary like our
    tiny character one, 99 tokens, has no even split); with `sequence_parallel`, the row-wise projections
    reduce-scatter over the sequence and the norms between them run on its shards."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel
    from transformers import PreTrainedModel

    styles = _styles()
    lm = next(
        m
        for m in root.modules()
        if isinstance(m, PreTrainedModel) and declared_plan(m.config.get_text_config())
    )
    base = _fqn(root, lm.base_model)
    at = f"{base}." if base else ""
    declared = declared_plan(lm.config)
    plan = {at + pattern: styles[style]() for pattern, style in declared.items()}
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if embed is None:  # a later pipeline stage: the first holds the embedding
        vocab = head.out_features if isinstance(head, torch.nn.Linear) else None
    else:
        vocab = embed.num_embeddings
    split_vocab = vocab is not None and vocab % tp == 0
    if split_vocab and embed is not None:
        plan[_fqn(root, embed)] = styles["vocab_embedding"]()
    if split_vocab and isinstance(head, torch.nn.Linear):  # not a pass-through of an earlier pipeline stage
        plan[_fqn(root, head)] = styles["colwise_gather_output"]()
    if sequence_parallel:
        for pattern, style in declared.items():
            if style == "rowwise":  # its output reduce-scattered over the sequence, kept a DTensor
                plan[at + pattern] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        plan |= _sequence_parallel_plan(at, _fqn(root, embed), split_vocab)
    return plan


def parallelize(root: torch.nn.Module, mesh, sequence_parallel: bool = False) -> torch.nn.Module:
    """Split `root`'s decoder over the 1-D TP `mesh`, in place (parameters become DTensors)."""
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import PreTrainedModel

    lm = next(m for m in root.modules() if isinstance(m, PreTrainedModel))
    head, embed = lm.get_output_embeddings(), lm.get_input_embeddings()
    # (a pipeline stage may hold one of the two: a pass-through or None in the other's place)
    tied = embed is not None and getattr(head, "weight", None) is embed.weight
    parallelize_module(root, mesh, module_plan(root, mesh.size(), sequence_parallel))
    if tied:  # parallelize_module gives each module its own DTensor: tie them again (same Shard(0) layout)
        lm.get_output_embeddings().weight = lm.get_input_embeddings().weight
    return root


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """clip_grad_norm_ over parameters laid out on different meshes: with tensor parallelism some are
    DTensors on the (dp, tp) mesh, some (FSDP over the replicas) on the dp mesh alone, some plain tensors whole
    on every worker. The global norm from each group's own, then one scale for all (as torch's: max_norm /
    (norm + 1e-6), only when below 1)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = squared_norm(grads) ** 0.5
    scale_to_norm(grads, total, max_norm)
    return total


def squared_norm(grads: list[torch.Tensor]) -> float:
    """The squared global norm of gradients on different meshes (collective over each DTensor's mesh):
    each mesh's own norm (torch's, whole over the mesh), plain tensors counted once."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = 0.0
    for same_mesh in groups.values():
        norm = torch.nn.utils.get_total_norm(same_mesh)
        squares += float(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    return squares


def scale_to_norm(grads: list[torch.Tensor], total: float, max_norm: float) -> None:
    """Scale gradients whose global norm is `total` down to max_norm, as torch's clip does (max_norm /
    (total + 1e-6), only when below 1); for norms torch cannot take over every layout at once."""
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
