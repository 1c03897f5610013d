"""Load and save any local Hugging Face causal LM (the tiny default or a real one) the same way."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from components.errors import ConfigError

hf_logging.disable_progress_bar()  # no per-load bars in pipeline logs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_dir(path: str | Path, key: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{key}={path}: no Hugging Face model there (config.json missing). Run `reinforge sft` "
                          "first, or point it at a local model directory; nothing is downloaded.")
    return p


def load_tokenizer(path: str | Path, key: str = "actor.model.path") -> PreTrainedTokenizerBase:
    """The tokenizer saved beside the model, left-padded for batched generation."""
    tok = AutoTokenizer.from_pretrained(_check_dir(path, key), local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | Path, dtype: str = "float32", attn: str = "sdpa",
               key: str = "actor.model.path", safetensors_only: bool = False) -> PreTrainedModel:
    """A causal LM from local disk only, in `dtype`, with the named attention kernel. safetensors_only
    (checkpoints we wrote) refuses any pickle-based weight file instead of falling back to it."""
    return AutoModelForCausalLM.from_pretrained(_check_dir(path, key), dtype=DTYPES[dtype],
                                                attn_implementation=attn, local_files_only=True,
                                                use_safetensors=True if safetensors_only else None)


def save_pretrained(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: str | Path,
                    state_dict: dict | None = None) -> Path:
    """Save model (safetensors) and tokenizer in Hugging Face format, atomically: into a temporary sibling
    directory that replaces `out` only once complete, so a crash never leaves a half-written model.
    `state_dict` (the whole model, gathered from sharded workers) is written instead of the model's own."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
