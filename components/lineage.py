"""Data lineage: DVC-style md5 of tracked files, checked against dvc.lock before training starts."""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from components.errors import DataError


def file_md5(path: str | Path) -> str:
    """The md5 DVC records for a file output."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def locked_md5s(lock: str | Path = "dvc.lock") -> dict[str, str]:
    """Output path -> md5 for every file output recorded in dvc.lock (empty when there is no lock)."""
    p = Path(lock)
    if not p.is_file():
        return {}
    data = yaml.safe_load(p.read_text()) or {}
    out = {}
    for stage in (data.get("stages") or {}).values():
        for o in stage.get("outs") or []:
            if "md5" in o and not str(o["md5"]).endswith(".dir"):
                out[str(Path(o["path"]))] = o["md5"]
    return out


def verify_tracked(paths: list[str | Path], lock: str | Path = "dvc.lock") -> dict[str, str]:
    """md5 of each path; DataError naming the file if DVC tracks it with a different hash."""
    locked = locked_md5s(lock)
    hashes = {}
    for path in paths:
        digest = file_md5(path)
        recorded = locked.get(str(Path(path)))
        if recorded is not None and recorded != digest:
            raise DataError(f"{path} was changed outside DVC (md5 {digest}, dvc.lock records {recorded}). "
                            "Run `dvc repro` to rebuild it, or `dvc commit` if the edit is intended.")
        hashes[str(path)] = digest
    return hashes
