"""Optimizer and learning-rate schedule from `actor.optimizer`."""

from __future__ import annotations

import torch

OPTIMIZERS = {
    "adamw": lambda params, c: torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay),
    "adam": lambda params, c: torch.optim.Adam(params, lr=c.lr, weight_decay=c.weight_decay),
    "sgd": lambda params, c: torch.optim.SGD(params, lr=c.lr, weight_decay=c.weight_decay),
}


def make_scheduler(opt: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warm-up over cfg.warmup_steps, then constant."""
    warm = cfg.warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)


def freeze_vision(model: torch.nn.Module, mcfg) -> int:
    """With actor.model.freeze_vision_model, the vision tower's parameters stop needing gradients (before any
    wrapper or optimizer sees them); returns how many tensors were frozen."""
    from components.models.vlm import vision_parameter

    if mcfg is None or not getattr(mcfg, "freeze_vision_model", False):
        return 0
    frozen = [p for n, p in model.named_parameters() if vision_parameter(n)]
    for p in frozen:
        p.requires_grad_(False)
    return len(frozen)


def param_groups(model: torch.nn.Module, lr: float, mcfg=None) -> list[dict]:
    """The parameters that train, as optimizer groups: for a VLM (actor.model.type=multimodal) the vision
    tower in a group of its own at lr x actor.model.vision_lr_ratio; frozen parameters in none."""
    from components.models.vlm import vision_parameter

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if mcfg is None or getattr(mcfg, "type", "text") != "multimodal":
        return [{"params": [p for _, p in named]}]
    text = [p for n, p in named if not vision_parameter(n)]
    vision = [p for n, p in named if vision_parameter(n)]
    groups = [{"params": text, "name": "text"}]
    if vision:
        groups.append({"params": vision, "lr": lr * mcfg.vision_lr_ratio, "name": "vision"})
    return groups


def make_optimizer(params, cfg) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer named by cfg.type and its schedule (make_scheduler)."""
    opt = OPTIMIZERS[cfg.type](params, cfg)
    return opt, make_scheduler(opt, cfg)
