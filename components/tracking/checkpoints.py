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
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from components.data.io import write_atomic
from components.errors import CheckpointError

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
    return unflatten_optimizer(load_file(directory / f"{name}.safetensors"),
                               json.loads((directory / f"{name}.json").read_text()))


def save_checkpoint(root: str | Path, iteration: int, write_files: Callable[[Path], Any], state: dict,
                    keep: int | None = None) -> Path:
    """Write checkpoint `iteration` atomically and move `latest` to it; returns its directory.

    write_files(tmp_dir) writes the worker's part (model, optimizer, worker state); state.json and the
    manifest are written here, state.json with `save_seconds` (how long write_files took). `keep` prunes all
    but the newest `keep` checkpoints."""
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
        manifest = {"iteration": iteration, "files": {str(p.relative_to(tmp)): sha256(p) for p in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=2))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    verify(final)
    write_atomic(root / "latest", lambda t: Path(t).write_text(name + "\n"))
    if keep:
        for old in sorted(root.glob("iter_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def verify(ckpt: Path) -> dict:
    """Check every file against the manifest; CheckpointError naming the first bad file."""
    manifest_path = ckpt / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST}; the checkpoint is incomplete")
    manifest = json.loads(manifest_path.read_text())
    for rel, digest in manifest["files"].items():
        p = ckpt / rel
        if not p.is_file():
            raise CheckpointError(f"{ckpt}: {rel} is missing")
        if sha256(p) != digest:
            raise CheckpointError(f"{ckpt}: {rel} fails its sha256 check (corrupted)")
    return manifest


def latest(root: str | Path) -> Path | None:
    """The checkpoint `latest` names, verified; None when there is none yet."""
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None
    ckpt = Path(root) / pointer.read_text().strip()
    verify(ckpt)
    return ckpt


def load_state(ckpt: Path) -> tuple[dict, dict | None]:
    """(state.json, optimizer state or None) of a verified checkpoint."""
    verify(ckpt)
    return json.loads((ckpt / "state.json").read_text()), load_optimizer(ckpt, "optimizer")


def clean_partial(root: str | Path) -> list[Path]:
    """Remove what interrupted saves left behind (.tmp_* directories and files); returns what was removed."""
    gone = sorted(Path(root).glob(".tmp_*")) + sorted(Path(root).glob(".latest.*.tmp"))
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return gone


def find_resumable(root: str | Path, fingerprint: str | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` that verifies (and matches `fingerprint` when given), and why each
    newer one was passed over. Tries the `latest` pointer first, then every iter_* from the newest down.
    None when there is no checkpoint at all; CheckpointError when there are some but none verifies."""
    root = Path(root)
    clean_partial(root)
    pointer = root / "latest"
    named = root / pointer.read_text().strip() if pointer.is_file() else None
    candidates = ([named] if named is not None else []) + sorted(root.glob("iter_*"), reverse=True)
    skipped: list[str] = []
    if named is not None and not named.is_dir():
        skipped.append(f"`latest` names {named.name}, which does not exist")
    bad: list[str] = []
    for ckpt in dict.fromkeys(c for c in candidates if c.is_dir()):
        try:
            verify(ckpt)
        except CheckpointError as exc:
            bad.append(str(exc))
            continue
        if fingerprint is not None and json.loads((ckpt / "state.json").read_text()).get("fingerprint") != fingerprint:
            skipped.append(f"{ckpt.name} was made with a different config")
            continue
        return ckpt, skipped + bad
    if bad:
        raise CheckpointError(f"no checkpoint under {root} verifies: " + "; ".join(bad) +
                              ". Restore one, or start fresh with trainer.resume_mode=disable.")
    return None, skipped
