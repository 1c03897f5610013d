"""Checkpoints: one directory per iteration, written to a temporary name, fsynced, then renamed.

Layout: <root>/iter_000020/{model/ (HF format, safetensors), optimizer.safetensors, optimizer.json,
state.json, manifest.json}; <root>/latest holds the name of the newest verified checkpoint and is
replaced atomically after its manifest verifies. Nothing is loaded with pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from components.data.io import write_atomic, write_json
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


def save_checkpoint(root: str | Path, iteration: int, write_model: Callable[[Path], Any], state: dict,
                    optimizer_state: dict | None = None, keep: int | None = None) -> Path:
    """Write checkpoint `iteration` atomically and move `latest` to it; returns its directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"iter_{iteration:06d}"
    final = root / name
    tmp = root / f".tmp_{name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_model(tmp / "model")
        if optimizer_state is not None:
            tensors, rest = flatten_optimizer(optimizer_state)
            save_file(tensors, tmp / "optimizer.safetensors")
            (tmp / "optimizer.json").write_text(json.dumps(rest, sort_keys=True))
        (tmp / "state.json").write_text(json.dumps({**state, "iteration": iteration}, sort_keys=True, indent=2))
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
    state = json.loads((ckpt / "state.json").read_text())
    opt = None
    if (ckpt / "optimizer.safetensors").is_file():
        opt = unflatten_optimizer(load_file(ckpt / "optimizer.safetensors"),
                                  json.loads((ckpt / "optimizer.json").read_text()))
    return state, opt


def write_metrics_json(obj: dict, path: str | Path) -> Path:
    return write_json(obj, path)
