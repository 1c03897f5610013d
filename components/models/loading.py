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


TRUST_KEY = "actor.model.trust_remote_code"
# files in which a model directory can ask transformers to import its own Python code (`auto_map`)
CODE_CONFIGS = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "image_processor_config.json",
    "feature_extractor_config.json",
)
OUR_MODEL_TYPES = ("reinforge_vlm",)  # components/models/vlm.py registers it with transformers


def json_object(path: Path, key: str) -> dict:
    """A model directory's JSON file as a dict: ConfigError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{key}: {path} is not readable JSON ({str(exc)[:120]}); restore it.") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: {path} holds a JSON {type(value).__name__}, not an object; restore it.")
    return value


def remote_code(p: Path, key: str) -> list[str]:
    """What in directory `p` asks transformers to run the directory's own Python code: its `auto_map`s."""
    found = []
    for name in CODE_CONFIGS:
        if (p / name).is_file():
            auto_map = json_object(p / name, key).get("auto_map")
            if auto_map:
                found.append(f"{name} auto_map {json.dumps(auto_map)[:120]}")
    return found


def known_model_types() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES) | set(OUR_MODEL_TYPES)


TRUST_HINT = f"set {TRUST_KEY}=true (that code then runs in every process that loads the model)"


def check_model_code(
    p: Path, path: str | Path, key: str, trust_remote_code: bool, trust_hint: str = TRUST_HINT
) -> dict:
    """A model directory is data, not code: one that asks to run its own Python is refused unless the user
    trusts it (`actor.model.trust_remote_code`), and one of an architecture transformers does not know is
    refused naming it. Returns its config.json."""
    config = json_object(p / "config.json", key)
    code = remote_code(p, key)
    if code and not trust_remote_code:
        raise ConfigError(
            f"{key}={path}: the model directory asks to run its own Python code ({code[0]}); reinforge runs "
            f"no code from a model directory unless you trust it: {trust_hint}, or use a model of an "
            "architecture transformers has."
        )
    model_type = config.get("model_type")
    if not code and model_type not in known_model_types():
        import transformers

        raise ConfigError(
            f"{key}={path}: config.json's model_type {str(model_type)[:60]!r} is not an architecture "
            f"transformers {transformers.__version__} knows; use a supported model, or upgrade transformers."
        )
    return config


MAX_MODEL_DIR_ENTRIES = 100_000  # a model directory's files and folders walked for links, at most


def link_root(p: Path) -> Path:
    """Where links in model directory `p` may lead: the directory itself, or for a snapshot of the Hugging Face
    cache (`models--org--name/snapshots/<revision>/`, whose files link to `../../blobs/`) the cached repository."""
    root = p.resolve()
    cached = root.parent.parent
    if root.parent.name == "snapshots" and cached.name.startswith("models--") and (cached / "blobs").is_dir():
        return cached
    return root


def check_links(p: Path, path: str | Path, key: str) -> None:
    """No symbolic link inside model directory `p` leads out of it (link_root): a tokenizer file linked to a
    system file would be read, weights linked elsewhere loaded. ConfigError naming the link, its target and
    `key` otherwise; directory links are not followed into."""
    root = link_root(p)
    seen = 0
    for folder, dirs, files in os.walk(p):
        seen += len(dirs) + len(files)
        if seen > MAX_MODEL_DIR_ENTRIES:
            raise ConfigError(
                f"{key}={path}: more than {MAX_MODEL_DIR_ENTRIES} files and folders; a model directory holds "
                "a config, a tokenizer and weights. Point it at the model's own directory."
            )
        for name in dirs + files:
            entry = Path(folder) / name
            if not entry.is_symlink():
                continue
            target = entry.resolve()
            if target != root and root not in target.parents:
                raise ConfigError(
                    f"{key}={path}: {entry.relative_to(p)} is a symbolic link to {target}, outside the model "
                    "directory, and a model directory's files are read from inside it only. Copy the file in "
                    "(cp --dereference), or point it at a directory without such links."
                )


def check_model_dir(
    path: str | Path, key: str, weights: bool = True, trust_remote_code: bool = False
) -> Path:
    """`path` as a Hugging Face model directory: config.json of an architecture transformers knows (a
    directory that asks to run its own code only with `trust_remote_code`), and (with `weights`) safetensors
    weights whose headers are sound and agree with the config. ConfigError naming `key` and the fix
    otherwise; nothing is loaded or allocated. No link inside it may lead out of it (check_links)."""
    p = Path(path)
    if p.is_dir():
        check_links(p, path, key)
    if is_adapter_dir(p):  # a LoRA adapter directory (peft): its weights, and the base model it names
        if not (p / ADAPTER_WEIGHTS).is_file():
            raise ConfigError(
                f"{key}={path}: adapter_config.json is there but not {ADAPTER_WEIGHTS}; copy it in, or point "
                "it at a complete adapter or model directory."
            )
        base = adapter_base(p)
        check_model_dir(
            base, f"{key} (the base model {p}/adapter_config.json names)", weights, trust_remote_code
        )
        if weights:
            check_safetensors([p / ADAPTER_WEIGHTS], key)
        return p
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"{key}={path}: no Hugging Face model there (config.json missing). Run `reinforge sft` "
            "first, or point it at a local model directory; nothing is downloaded."
        )
    config = check_model_code(p, path, key, trust_remote_code)
    if not weights:
        return p
    files = weight_files(p, key)
    if files:
        check_weights_agree(config, check_safetensors(files, key), p, key)
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


def weight_files(p: Path, key: str) -> list[Path]:
    """The directory's safetensors files: model.safetensors, or the shards its index names (plain file names
    inside the directory only), or model-*.safetensors."""
    index = p / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json_object(index, key).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{key}: {index} has no weight_map; restore it from the model's source.")
        names = sorted({str(v) for v in weight_map.values()})
        bad = [n for n in names if Path(n).name != n or not n.endswith(".safetensors")]
        if bad:
            raise ConfigError(f"{key}: {index} names {bad[0]!r}, not a .safetensors file in {p}; restore it.")
        missing = [n for n in names if not (p / n).is_file()]
        if missing:
            raise ConfigError(f"{key}: {index} names {missing[0]}, which is not in {p}; copy the shard in.")
        return [p / n for n in names]
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    return sorted(p.glob("model-*.safetensors"))


# safetensors dtypes and their sizes in bits
ST_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "F4": 4, "F6_E2M3": 6,
    "F6_E3M2": 6,
}  # fmt: skip
MAX_HEADER = 100 * 2**20  # safetensors' own bound on a header


def check_safetensors(files: list[Path], key: str) -> dict[str, list[int]]:
    """Each file's header, read as safetensors itself bounds it (8-byte length, then JSON) without loading a
    tensor: every tensor's dtype known, shape non-negative, and its bytes exactly inside the file. A pickle
    under a .safetensors name, a truncated file or a header that lies about its tensors is ConfigError naming
    the file. Returns {tensor name: shape} over all files."""
    import struct

    shapes: dict[str, list[int]] = {}
    for f in files:
        size = f.stat().st_size
        with f.open("rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            problem = None
            if not 2 <= n <= min(MAX_HEADER, size - 8):
                problem = "its first 8 bytes are not a header length (a truncated file, or not safetensors)"
            else:
                try:
                    header = json.loads(fh.read(n))
                except (UnicodeDecodeError, ValueError):
                    header, problem = None, "its header is not JSON"
                if header is not None:
                    problem = _header_problem(header, size - 8 - n, shapes)
        if problem:
            raise ConfigError(
                f"{key}: {f} is not a sound safetensors file: {problem}. Re-download or re-save the weights."
            )
    return shapes


def _header_problem(header: object, data_bytes: int, shapes: dict[str, list[int]]) -> str | None:
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    covered = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in ST_BITS:
            return f"tensor {str(name)[:60]!r} has no known dtype"
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            return f"tensor {str(name)[:60]!r} has a malformed shape"
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"tensor {str(name)[:60]!r} has malformed data offsets"
        begin, end = offsets
        count = 1
        for d in shape:
            count *= d
        if not 0 <= begin <= end <= data_bytes or (end - begin) * 8 != count * ST_BITS[info["dtype"]]:
            return (
                f"tensor {str(name)[:60]!r} claims {shape} {info['dtype']} at bytes {offsets} of {data_bytes}"
            )
        covered += end - begin
        shapes[name] = shape
    if covered > data_bytes:
        return "its tensors overlap"
    return None


def check_weights_agree(config: dict, shapes: dict[str, list[int]], p: Path, key: str) -> None:
    """The config's vocabulary size and layer count are the weights': a config that lies (an absurd
    vocabulary, more or fewer layers than stored) is refused before anything is allocated."""
    import re

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab, layers = text.get("vocab_size"), text.get("num_hidden_layers")
    embeddings = [s for n, s in shapes.items() if n.endswith(("embed_tokens.weight", "wte.weight"))]
    if isinstance(vocab, int) and embeddings and embeddings[0] and embeddings[0][0] != vocab:
        raise ConfigError(
            f"{key}={p}: config.json's vocab_size {vocab} is not the embedding's {embeddings[0][0]} rows in "
            "the weights; restore the config that came with these weights."
        )
    found = {int(m.group(1)) for n in shapes if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", n))}
    # a VLM's weights hold the vision tower's layers too: only a text model's are counted
    if "vision_config" not in config and isinstance(layers, int) and found and max(found) + 1 != layers:
        raise ConfigError(
            f"{key}={p}: config.json's num_hidden_layers {layers} is not the {max(found) + 1} layers in the "
            "weights; restore the config that came with these weights."
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


def load_tokenizer(
    path: str | Path, key: str = "actor.model.path", trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside the model, exactly as saved (checked), left-padded for batched generation.
    `trust_remote_code` is passed to transformers explicitly, so it never asks on stdin."""
    p = check_model_dir(path, key, weights=False, trust_remote_code=trust_remote_code)
    cls = _tokenizer_class(p)
    try:
        if cls in GENERIC_TOKENIZERS and (p / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(
                p, local_files_only=True, trust_remote_code=trust_remote_code
            )
        else:
            tok = AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=trust_remote_code)
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
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A causal LM from local disk only, in `dtype`, with the named attention kernel. Weights load from
    safetensors only (check_model_dir refuses a pickle-only directory with the command that converts it). A
    LoRA adapter directory loads as its base model with the adapters merged. A directory's own code runs only
    with `trust_remote_code` (actor.model.trust_remote_code)."""
    p = check_model_dir(path, key, weights=safetensors_only, trust_remote_code=trust_remote_code)
    if is_adapter_dir(p):  # LoRA adapters: their base with them merged in, one plain model
        return load_merged(
            p, lambda base: load_model(base, dtype, attn, key, safetensors_only, trust_remote_code)
        )
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
        trust_remote_code=trust_remote_code,
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


def load_image_encoder(
    path: str | Path, tokenizer, key: str = "actor.model.path", trust_remote_code: bool = False
):
    """The ImageEncoder of a vision-language model directory (components.data.images), None for a text model."""
    from components.data.images import ImageEncoder

    if not is_vlm_dir(path):
        return None
    from components.models.vlm import load_processor, processor_image_tokens

    processor = load_processor(path, tokenizer, key, trust_remote_code)
    return ImageEncoder(processor, processor_image_tokens(processor))


def teacher_tokenizer_problem(
    student_path: str | Path, teacher_path: str | Path, trust_remote_code: bool = False
) -> str | None:
    """Why the teacher at `teacher_path` cannot score the student's tokens (None: it can): distillation
    compares the two models' log-probs of the same token ids, so their vocabularies must be one."""
    student = load_tokenizer(student_path, "actor.model.path", trust_remote_code)
    teacher = load_tokenizer(teacher_path, "distill.teacher_path", trust_remote_code)
    if student.get_vocab() != teacher.get_vocab() or student.eos_token_id != teacher.eos_token_id:
        return (
            f"distill.teacher_path={teacher_path}: its tokenizer is not the student's (actor.model.path="
            f"{student_path}: {len(student)} tokens against {len(teacher)}, or other ids); on-policy "
            "distillation scores the student's token ids with the teacher, so use a teacher of the same "
            "tokenizer"
        )
    return None
