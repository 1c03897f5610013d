"""Tensor parallelism (actor.tensor_model_parallel_size): each decoder layer's matmuls split across the TP
workers of a data-parallel replica with PyTorch's DTensor (`parallelize_module`), by the plan transformers
itself declares for the architecture (`config.base_model_tp_plan`: Llama, Qwen2, Mistral, ...): q/k/v and
gate/up column-wise, o and down row-wise. The embedding and the LM head are split over the vocabulary when
the TP size divides it (a tied head stays tied: both hold the same Shard(0) DTensor). Norms stay whole on
every TP worker: with replicated activations between blocks their gradients come out equal on each.

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


def declared_plan(config) -> dict[str, str]:
    """The architecture's TP plan as transformers declares it for the base model ({} when it has none)."""
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def plan_problems(model_dir: str, tp: int, key: str = "actor.model.path") -> list[str]:
    """Why the model in `model_dir` cannot be split over `tp` workers, each naming the key and the fix; []
    when it can (or when the directory does not exist yet: the worker checks again when it loads it)."""
    if tp == 1 or not (Path(model_dir) / "config.json").is_file():
        return []
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if "vision_config" in raw:
        return [
            f"actor.tensor_model_parallel_size={tp} with the vision-language model in {key}={model_dir}: "
            "tensor parallelism splits text decoders only in this version; set it to 1."
        ]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    text = config.get_text_config()
    if not declared_plan(text):
        return [
            f"actor.tensor_model_parallel_size={tp}: {key}={model_dir} is a {text.model_type} model, which has "
            "no tensor-parallel plan (the Llama family has one: Llama, Qwen2, Mistral); set it to 1."
        ]
    problems = []
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


def module_plan(root: torch.nn.Module, tp: int) -> dict[str, object]:
    """{module path pattern: ParallelStyle} for the causal LM inside `root` (the policy itself, or a critic's
    backbone): the base model's declared plan under its path, then the input embedding and the LM head split
    over the vocabulary when `tp` divides it (else they stay whole on every worker: a vocabulary like our
    tiny character one, 99 tokens, has no even split)."""
    from transformers import PreTrainedModel

    styles = _styles()
    lm = next(
        m
        for m in root.modules()
        if isinstance(m, PreTrainedModel) and declared_plan(m.config.get_text_config())
    )
    base = _fqn(root, lm.base_model)
    at = f"{base}." if base else ""
    plan = {at + pattern: styles[style]() for pattern, style in declared_plan(lm.config).items()}
    if lm.get_input_embeddings().num_embeddings % tp:
        return plan
    plan[_fqn(root, lm.get_input_embeddings())] = styles["vocab_embedding"]()
    head = lm.get_output_embeddings()
    if head is not None:
        plan[_fqn(root, head)] = styles["colwise_gather_output"]()
    return plan


def parallelize(root: torch.nn.Module, mesh) -> torch.nn.Module:
    """Split `root`'s decoder over the 1-D TP `mesh`, in place (parameters become DTensors)."""
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import PreTrainedModel

    lm = next(m for m in root.modules() if isinstance(m, PreTrainedModel))
    tied = lm.get_output_embeddings() is not None and (
        lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    )
    parallelize_module(root, mesh, module_plan(root, mesh.size()))
    if tied:  # parallelize_module gives each module its own DTensor: tie them again (same Shard(0) layout)
        lm.get_output_embeddings().weight = lm.get_input_embeddings().weight
    return root


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """clip_grad_norm_ over parameters laid out on different meshes: with tensor parallelism some are
    DTensors on the (dp, tp) mesh, some (FSDP over the replicas) on the dp mesh alone, some plain tensors whole
    on every worker. The global norm from each group's own, then one scale for all (as torch's: max_norm /
    (norm + 1e-6), only when below 1)."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p.grad)
    squares = 0.0
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        squares += float(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    total = squares**0.5
    scale_to_norm([g for grads in groups.values() for g in grads], total, max_norm)
    return total


def scale_to_norm(grads: list[torch.Tensor], total: float, max_norm: float) -> None:
    """Scale gradients whose global norm is `total` down to max_norm, as torch's clip does (max_norm /
    (total + 1e-6), only when below 1); for norms torch cannot take over every layout at once."""
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
