"""Data lineage: DVC-style md5 of tracked files, checked against dvc.lock before training starts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from components.errors import DataError


def file_md5(path: str | Path) -> str:
    """The md5 DVC records for a file output."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_digest(path: str | Path, whole_below: int = 64 << 20, edge: int = 4 << 20) -> str:
    """md5 over a model directory's files (names, sizes, contents), for the resume fingerprint: a checkpoint
    is only continued from the same starting model. Files above `whole_below` bytes (a real model's weight
    shards) are hashed by size and their first and last `edge` bytes, so a 15 GB model costs milliseconds.
    A missing directory digests to ''."""
    root = Path(path)
    if not root.is_dir():
        return ""
    h = hashlib.md5()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.relative_to(root)}\0{size}\0".encode())
        if size <= whole_below:
            h.update(file_md5(f).encode())
            continue
        with open(f, "rb") as fh:
            h.update(fh.read(edge))
            fh.seek(size - edge)
            h.update(fh.read(edge))
    return h.hexdigest()


def _dir_listing(repo: Path, out_path: str, dir_md5: str) -> dict[str, str]:
    """The files of a directory output, from DVC's cache (.dvc/cache/files/md5/xx/rest.dir); empty if absent."""
    digest = dir_md5[: -len(".dir")]
    listing = repo / ".dvc" / "cache" / "files" / "md5" / digest[:2] / f"{digest[2:]}.dir"
    if not listing.is_file():
        return {}
    return {str(Path(out_path) / e["relpath"]): e["md5"] for e in json.loads(listing.read_text())}


def locked_md5s(lock: str | Path = "dvc.lock") -> dict[str, str]:
    """File path -> md5 for every output recorded in dvc.lock: file outputs directly, the files of directory
    outputs through their listing in DVC's cache (empty when there is no lock)."""
    p = Path(lock)
    if not p.is_file():
        return {}
    from components.config.loader import load_yaml_text  # linear in the file, whatever its aliases

    data = load_yaml_text(p.read_text(), str(p)) or {}
    out = {}
    for stage in (data.get("stages") or {}).values():
        for o in stage.get("outs") or []:
            md5 = str(o.get("md5", ""))
            if md5.endswith(".dir"):
                out.update(_dir_listing(p.parent, o["path"], md5))
            elif md5:
                out[str(Path(o["path"]))] = md5
    return out


def verify_tracked(paths: list[str | Path], lock: str | Path = "dvc.lock") -> dict[str, str]:
    """md5 of each path; DataError naming the file if DVC tracks it with a different hash."""
    locked = locked_md5s(lock)
    hashes = {}
    for path in paths:
        digest = file_md5(path)
        recorded = locked.get(str(Path(path)))
        if recorded is not None and recorded != digest:
            raise DataError(
                f"{path} was changed outside DVC (md5 {digest}, dvc.lock records {recorded}). "
                "Run `dvc repro` to rebuild it, or `dvc commit` if the edit is intended."
            )
        hashes[str(path)] = digest
    return hashes
