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


def make_optimizer(params, cfg) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer named by cfg.type and its schedule (make_scheduler)."""
    opt = OPTIMIZERS[cfg.type](params, cfg)
    return opt, make_scheduler(opt, cfg)
