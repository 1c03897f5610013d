"""Rollout engines behind one interface (token ids in, token ids + log-probs out), chosen by `engine.type`.

The names below are imported on first use, so a light submodule (tools, completions) does not pull in torch.
"""

from __future__ import annotations

import importlib

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "make_engine"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'components.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module("components.rollout.base"), name)
