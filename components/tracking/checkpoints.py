"""Checkpoints: one directory per iteration, written to a temporary name, fsynced, then renamed.

Layout: <root>/iter_000020/{model/ (HF format, safetensors), optimizer.safetensors + optimizer.json,
worker.json + worker.safetensors (scheduler, RNG states, step counters), critic*.safetensors (ppo),
state.json (sampler position, weights version, MLflow run id, config fingerprint), manifest.json (sha256 of
every file)}; <root>/latest holds the name of the newest verified checkpoint and is replaced atomically
after its manifest verifies. Nothing is loaded with pickle: tensors through safetensors, the rest as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from components.data.io import write_atomic
from components.errors import CheckpointError, OutputError, no_space

MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state_dict -> (tensors for safetensors, the JSON-able rest)."""
    tensors, scalars = {}, {}
    for pid, slots in state["state"].items():
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *rest["scalars"].items()]:
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    return {"state": state, "param_groups": rest["param_groups"]}


def save_optimizer(directory: Path, name: str, state: dict) -> None:
    """An optimizer state_dict as <name>.safetensors (tensors) + <name>.json (the rest)."""
    tensors, rest = flatten_optimizer(state)
    save_file(tensors, directory / f"{name}.safetensors")
    (directory / f"{name}.json").write_text(json.dumps(rest, sort_keys=True))


def load_optimizer(directory: Path, name: str) -> dict | None:
    """The optimizer state saved by save_optimizer, or None when the checkpoint has none."""
    if not (directory / f"{name}.safetensors").is_file():
        return None
    return unflatten_optimizer(
        load_file(directory / f"{name}.safetensors"), json.loads((directory / f"{name}.json").read_text())
    )


def save_checkpoint(
    root: str | Path, iteration: int, write_files: Callable[[Path], Any], state: dict, keep: int | None = None
) -> Path:
    """Write checkpoint `iteration` atomically and move `latest` to it; returns its directory.

    write_files(tmp_dir) writes the worker's part (model, optimizer, worker state); state.json and the
    manifest are written here, state.json with `save_seconds` (how long write_files took). `keep` prunes the
    checkpoints older than this one down to the newest `keep` in all; `root` holds one run's checkpoints only
    (components/tracking/runs.py), so no other run's are ever touched."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"iter_{iteration:06d}"
    final = root / name
    tmp = root / f".tmp_{name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        start = time.perf_counter()
        write_files(tmp)
        state = {**state, "iteration": iteration, "save_seconds": time.perf_counter() - start}
        (tmp / "state.json").write_text(json.dumps(state, sort_keys=True, indent=2))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "iteration": iteration,
            "files": {p.relative_to(tmp).as_posix(): sha256(p) for p in files},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=2))
        _fsync_tree(tmp)
        replace_dir(tmp, final)
    except BaseException as exc:
        written = tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if no_space(exc):
            raise _full_disk(root, final, written) from None
        raise
    verify(final)
    write_atomic(root / "latest", lambda t: Path(t).write_text(name + "\n"))
    if keep:
        older = sorted(c for c in root.glob("iter_*") if _NAME.match(c.name) and c.name < name)
        for old in older[: max(len(older) - (keep - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def tree_bytes(root: Path) -> int:
    """The bytes of the files under `root` (0 when it is not a directory)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


def _full_disk(root: Path, ckpt: Path, written: int) -> OutputError:
    """One line: where, how much room there is, how much a checkpoint of this run takes, what was kept."""
    mib = 2**20
    previous = pointer_target(root)
    needed = max(written, tree_bytes(previous) if previous else 0)
    free = shutil.disk_usage(root).free
    kept = f"`latest` still names {previous.name}" if previous else "no earlier checkpoint exists"
    return OutputError(
        f"no space left on the device of {root} writing checkpoint {ckpt.name} ({free / mib:.0f} MiB free; "
        f"a checkpoint of this run takes about {needed / mib:.0f} MiB): the partial checkpoint was removed and "
        f"{kept}. Free space there or move trainer.output_dir to a disk with room, then run the same command "
        "to resume."
    )


def replace_dir(new: Path, target: Path) -> None:
    """Put directory `new` at `target`: a previous `target` (ours to replace) is renamed aside first and
    removed only after the rename, so `target` is never missing or half-written."""
    old = target.parent / f".old_{target.name}_{os.getpid()}"
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


# files every checkpoint holds; weights are model/*.safetensors
REQUIRED = ("state.json", "model/config.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_NAME = re.compile(r"^iter_\d{6}$")


def _files_on_disk(ckpt: Path) -> set[str]:
    """Every regular file under `ckpt` (relative names); CheckpointError at the first symlink or other
    non-regular entry, which could lead outside the checkpoint."""
    found = set()
    for parent, dirs, files in os.walk(ckpt, followlinks=False):
        for name in dirs + files:
            p = Path(parent) / name
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                raise CheckpointError(
                    f"{ckpt}: {p.relative_to(ckpt)} is a symlink; a checkpoint holds regular files only"
                )
            if name in files and not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{ckpt}: {p.relative_to(ckpt)} is not a regular file")
            if name in files:
                found.add(p.relative_to(ckpt).as_posix())
    return found


def _manifest(ckpt: Path) -> dict[str, str]:
    """The manifest's {relative name: sha256}; CheckpointError when it is missing or malformed."""
    path = ckpt / MANIFEST
    if path.is_symlink() or not path.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST}; the checkpoint is incomplete")
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{ckpt}: {MANIFEST} is malformed ({type(exc).__name__}); the checkpoint is corrupt"
        ) from None
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        raise CheckpointError(f"{ckpt}: {MANIFEST} is malformed (files is not a name -> sha256 mapping)")
    for name in files:
        parts = name.split("/")
        if name.startswith("/") or "\\" in name or any(part in ("", ".", "..") for part in parts):
            raise CheckpointError(
                f"{ckpt}: {MANIFEST} names {name!r}, which is not a plain path inside the checkpoint"
            )
    return files


def verify(ckpt: Path) -> dict:
    """A checkpoint that cannot be fooled: a real directory of regular files (no symlinks), a manifest naming
    exactly the files present (plain relative names), each matching its sha256, the required files among
    them, no pickle-format file, and a state.json that parses. CheckpointError naming the first problem."""
    ckpt = Path(ckpt)
    if ckpt.is_symlink() or not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: not a checkpoint directory (missing, or a symlink)")
    files = _manifest(ckpt)
    on_disk = _files_on_disk(ckpt) - {MANIFEST}
    if set(files) != on_disk:
        extra, missing = sorted(on_disk - set(files)), sorted(set(files) - on_disk)
        what = f"{missing[0]} is missing" if missing else f"{extra[0]} is not in its {MANIFEST}"
        raise CheckpointError(f"{ckpt}: {what}; the checkpoint is incomplete or was altered")
    pickled = [n for n in files if n.endswith(PICKLE_SUFFIXES)]
    if pickled:
        raise CheckpointError(
            f"{ckpt}: {pickled[0]} is a pickle-format file; checkpoints hold safetensors and JSON only"
        )
    absent = [name for name in REQUIRED if name not in files]
    if not any(n.startswith("model/") and n.endswith(".safetensors") for n in files):
        absent.append("model/*.safetensors")
    if absent:
        raise CheckpointError(f"{ckpt}: its {MANIFEST} lists no {absent[0]}; the checkpoint is incomplete")
    for rel, digest in sorted(files.items()):
        if sha256(ckpt / rel) != digest:
            raise CheckpointError(f"{ckpt}: {rel} fails its sha256 check (corrupted)")
    try:
        if not isinstance(json.loads((ckpt / "state.json").read_text()), dict):
            raise ValueError("not an object")
    except ValueError as exc:
        raise CheckpointError(f"{ckpt}: state.json is malformed ({exc})") from None
    return {"files": files}


def read_state(ckpt: Path) -> dict:
    """state.json of a checkpoint that verify() passed."""
    return json.loads((Path(ckpt) / "state.json").read_text())


def pointer_target(root: Path) -> Path | None:
    """The checkpoint `latest` names, when it names a sibling iter_NNNNNN directory; None otherwise."""
    pointer = root / "latest"
    if pointer.is_symlink() or not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    return root / name if _NAME.match(name) else None


# config.json keys that fix the shapes of a model's tensors
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def check_same_shapes(ckpt: Path, model_path: str | Path, key: str = "actor.model.path") -> None:
    """CheckpointError when the checkpoint's model and the one at `model_path` differ in any SHAPE_KEYS (its
    weights would not load into the policy), naming each differing key."""

    def shape(config: Path) -> dict:
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            return {}
        return {k: data.get(k) for k in SHAPE_KEYS}

    theirs, ours = shape(ckpt / "model" / "config.json"), shape(Path(model_path) / "config.json")
    differ = [f"{k} {theirs[k]} vs {ours[k]}" for k in SHAPE_KEYS if theirs.get(k) != ours.get(k)]
    if theirs and ours and differ:
        raise CheckpointError(
            f"{ckpt}: its model differs in shape from {key}={model_path} ({', '.join(differ)}), "
            "so it cannot be resumed into this policy. Resume a checkpoint of this model, or start "
            "fresh with trainer.resume_mode=disable."
        )


def latest(root: str | Path) -> Path | None:
    """The checkpoint `latest` names, verified; None when there is none yet. CheckpointError when `latest`
    names something other than a sibling checkpoint."""
    root = Path(root)
    pointer = root / "latest"
    if not pointer.is_file() and not pointer.is_symlink():
        return None
    ckpt = pointer_target(root)
    if ckpt is None:
        raise CheckpointError(f"{pointer} does not name a checkpoint of {root} (iter_NNNNNN)")
    verify(ckpt)
    return ckpt


def load_state(ckpt: Path) -> tuple[dict, dict | None]:
    """(state.json, optimizer state or None) of a verified checkpoint."""
    verify(ckpt)
    return read_state(ckpt), load_optimizer(ckpt, "optimizer")


def clean_partial(root: str | Path) -> list[Path]:
    """Remove what interrupted saves left behind (.tmp_* directories and files); returns what was removed."""
    gone = (
        sorted(Path(root).glob(".tmp_*"))
        + sorted(Path(root).glob(".old_*"))
        + sorted(Path(root).glob(".latest.*.tmp"))
    )
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return gone


def find_resumable(root: str | Path, fingerprint: str | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` that verifies (and matches `fingerprint` when given), and why each
    newer one was passed over. Tries the `latest` pointer first, then every iter_* from the newest down.
    None when there is no checkpoint at all; CheckpointError when there are some but none verifies."""
    root = Path(root)
    clean_partial(root)
    named = pointer_target(root)
    skipped: list[str] = []
    if (root / "latest").exists() and named is None:
        skipped.append(f"`latest` in {root} does not name a checkpoint of it (iter_NNNNNN); ignored")
    elif named is not None and not named.is_dir():
        skipped.append(f"`latest` names {named.name}, which does not exist")
    candidates = ([named] if named is not None else []) + sorted(
        (c for c in root.glob("iter_*") if _NAME.match(c.name)), reverse=True
    )
    bad: list[str] = []
    for ckpt in dict.fromkeys(c for c in candidates if c.is_dir() or c.is_symlink()):
        try:
            verify(ckpt)
        except CheckpointError as exc:
            bad.append(str(exc))
            continue
        if fingerprint is not None and read_state(ckpt).get("fingerprint") != fingerprint:
            skipped.append(f"{ckpt.name} was made with a different config")
            continue
        return ckpt, skipped + bad
    if bad:
        raise CheckpointError(
            f"no checkpoint under {root} verifies: "
            + "; ".join(bad)
            + ". Restore one, or start fresh with trainer.resume_mode=disable."
        )
    return None, skipped
