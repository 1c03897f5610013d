"""Load and save any local Hugging Face causal LM (the tiny default or a real one) the same way.

A tokenizer comes back exactly as it was saved: a directory whose tokenizer_config.json names the generic
class (`TokenizersBackend`, `PreTrainedTokenizerFast`) is loaded from its tokenizer.json as written, because
transformers 5 otherwise rebuilds the pipeline of the model type's own class (a Qwen2 model gets Qwen2's
byte-level pre-tokenizer, which drops the spaces of our character tokenizer). Every load is then checked:
probe texts must encode to the ids the saved tokenizer.json gives them, or the load fails naming the
directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from components.errors import ConfigError, OutputError
from components.models.lora import ADAPTER_WEIGHTS, adapter_base, is_adapter_dir, load_merged
from components.outputs import MODEL, marker_kind, write_marker

if TYPE_CHECKING:  # transformers' modeling code is imported by load_model only (~4 s): drivers never need it
    from transformers import PreTrainedModel

hf_logging.disable_progress_bar()  # no per-load bars in pipeline logs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# tokenizer classes whose definition is the saved tokenizer.json itself
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")

# texts every loaded tokenizer must encode as its saved tokenizer.json does: spaces, newlines, digits,
# punctuation and non-ASCII (a vocabulary without them maps them to its unknown token, the same way)
PROBES = (
    "Q: 25+60=? A: #### 85",
    "line one\nline two\n\n  indented\ttab",
    "(3 * 4) - 7 / 2 = 8.5, isn't it? [x] {y} <z> 'q' \"r\" ~!@#$%^&_|\\",
    "café naïve 中文 ١٢٣ 🙂 １＋２＝",
)

SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def check_model_dir(path: str | Path, key: str, weights: bool = True) -> Path:
    """`path` as a Hugging Face model directory: config.json, and (with `weights`) safetensors weights.
    ConfigError naming `key` and the fix otherwise; nothing is loaded."""
    p = Path(path)
    if is_adapter_dir(p):  # a LoRA adapter directory (peft): its weights, and the base model it names
        if not (p / ADAPTER_WEIGHTS).is_file():
            raise ConfigError(
                f"{key}={path}: adapter_config.json is there but not {ADAPTER_WEIGHTS}; copy it in, or point "
                "it at a complete adapter or model directory."
            )
        check_model_dir(adapter_base(p), f"{key} (the base model {p}/adapter_config.json names)", weights)
        return p
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"{key}={path}: no Hugging Face model there (config.json missing). Run `reinforge sft` "
            "first, or point it at a local model directory; nothing is downloaded."
        )
    if not weights:
        return p
    if any((p / name).is_file() for name in SAFE_WEIGHTS) or any(p.glob("model-*.safetensors")):
        return p
    pickled = [name for name in PICKLE_WEIGHTS if (p / name).is_file()] + [f.name for f in p.glob("*.bin")]
    if pickled:
        raise ConfigError(
            f"{key}={path}: its weights are only in pickle format ({pickled[0]}); reinforge loads safetensors "
            "only, because unpickling can run code. Convert them once, trusting the file: "
            f'python -c "from transformers import AutoModelForCausalLM as M; '
            f"M.from_pretrained('{p}').save_pretrained('{p}', safe_serialization=True)\""
        )
    raise ConfigError(
        f"{key}={path}: config.json is there but no weights (model.safetensors or "
        "model-*.safetensors shards). Copy the weights in, or point it at a complete model directory."
    )


def _tokenizer_class(path: Path) -> str | None:
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config}: not readable JSON ({exc}); restore the tokenizer files.") from None


def check_round_trip(tokenizer: PreTrainedTokenizerBase, path: Path, key: str) -> None:
    """The loaded tokenizer encodes PROBES to the same ids as the saved tokenizer.json, and decodes them
    back to the same text where the vocabulary holds every character. ConfigError naming `path` if not."""
    saved = path / "tokenizer.json"
    if not saved.is_file():  # a tokenizer without a tokenizer.json: nothing saved to compare with
        return
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(saved))
    unk = tokenizer.unk_token_id
    for text in PROBES:
        want = reference.encode(text, add_special_tokens=False).ids
        got = tokenizer(text, add_special_tokens=False)["input_ids"]
        if got != want:
            raise ConfigError(
                f"{key}={path}: the tokenizer transformers loads ({type(tokenizer).__name__}) encodes {text!r} "
                f"differently from the saved tokenizer.json ({got[:12]} vs {want[:12]}), so the model would see "
                'other text than it was trained on. Set "tokenizer_class": "TokenizersBackend" in '
                f"{path / 'tokenizer_config.json'} to load tokenizer.json as saved."
            )
        if unk is not None and unk in got:
            continue
        back = tokenizer.decode(got)
        if back != text and back != reference.decode(want, skip_special_tokens=False):
            raise ConfigError(
                f"{key}={path}: the tokenizer decodes {text!r} back as {back!r}; its decoder does "
                "not match its encoder. Re-save the tokenizer."
            )


def load_tokenizer(path: str | Path, key: str = "actor.model.path") -> PreTrainedTokenizerBase:
    """The tokenizer saved beside the model, exactly as saved (checked), left-padded for batched generation."""
    p = check_model_dir(path, key, weights=False)
    cls = _tokenizer_class(p)
    try:
        if cls in GENERIC_TOKENIZERS and (p / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(p, local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"{key}={path}: its tokenizer could not be loaded ({type(exc).__name__}: "
            f"{str(exc)[:200]}). Check the tokenizer files in that directory."
        ) from None
    check_round_trip(tok, p, key)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    path: str | Path,
    dtype: str = "float32",
    attn: str = "sdpa",
    key: str = "actor.model.path",
    safetensors_only: bool = True,
) -> PreTrainedModel:
    """A causal LM from local disk only, in `dtype`, with the named attention kernel. Weights load from
    safetensors only (check_model_dir refuses a pickle-only directory with the command that converts it). A
    LoRA adapter directory loads as its base model with the adapters merged."""
    p = check_model_dir(path, key, weights=safetensors_only)
    if is_adapter_dir(p):  # LoRA adapters: their base with them merged in, one plain model
        return load_merged(p, lambda base: load_model(base, dtype, attn, key, safetensors_only))
    if is_vlm_dir(p):  # a vision-language model (ours, LLaVA): transformers' image-text-to-text classes
        from transformers import AutoModelForImageTextToText

        auto = AutoModelForImageTextToText
    else:
        from transformers import AutoModelForCausalLM

        auto = AutoModelForCausalLM
    return auto.from_pretrained(
        p,
        dtype=DTYPES[dtype],
        attn_implementation=attn,
        local_files_only=True,
        use_safetensors=True if safetensors_only else None,
    )


def save_pretrained(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: str | Path,
    state_dict: dict | None = None,
    kind: str = MODEL,
    processor=None,
) -> Path:
    """Save model (safetensors) and tokenizer in Hugging Face format, atomically: into a temporary sibling
    directory that replaces `out` only once complete, so a crash never leaves a half-written model.
    `state_dict` (the whole model, gathered from sharded workers) is written instead of the model's own; a
    VLM's `processor` is saved with it (its image processor and the tokenizer).
    The directory is marked as an output of `kind`; an existing `out` is replaced only when it carries that
    mark (components.outputs), never a directory reinforge did not write."""
    from components.tracking.checkpoints import replace_dir

    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and marker_kind(out) != kind)):
        raise OutputError(
            f"{out} exists and is not a {kind} reinforge wrote, so it is not replaced; give a new "
            "directory, or move it away."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        (processor or tokenizer).save_pretrained(tmp)  # a VLM's processor saves its tokenizer too
        write_marker(tmp, kind)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def image_token_id(model) -> int | None:
    """The token a VLM's prompts carry images with (None for a text model). It is never sampled: the policy's
    distribution leaves it out, in the engine and in the trainer's log-probs alike (an `<image>` in a response
    would ask the model's forward for an image that is not there)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vision_config", None) is None:
        return None
    found = getattr(config, "image_token_id", None)
    return found if found is not None else getattr(config, "image_token_index", None)


def is_vlm_dir(path) -> bool:
    """Whether the model directory holds a vision-language model (its config names a vision config)."""
    import json
    from pathlib import Path

    config = Path(path) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def load_image_encoder(path: str | Path, tokenizer, key: str = "actor.model.path"):
    """The ImageEncoder of a vision-language model directory (components.data.images), None for a text model."""
    from components.data.images import ImageEncoder

    if not is_vlm_dir(path):
        return None
    from components.models.vlm import load_processor, processor_image_tokens

    processor = load_processor(path, tokenizer, key)
    return ImageEncoder(processor, processor_image_tokens(processor))
