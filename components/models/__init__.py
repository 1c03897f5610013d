"""Models: the tiny local Qwen2 policy and its character tokenizer; loading any local HF causal LM.

The names below are imported on first use: `components.models.lora` (its settings are part of every plan)
must not pull transformers' modeling code into a driver that never builds a model (~4 s per process).
"""

from __future__ import annotations

import importlib

_HOMES = {
    "load_model": "components.models.loading",
    "load_tokenizer": "components.models.loading",
    "save_pretrained": "components.models.loading",
    "build_char_tokenizer": "components.models.tiny",
    "build_tiny_model": "components.models.tiny",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'components.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
