"""A non-blocking file lock so that two runs of one pipeline never train at once."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from components.errors import ReinforgeError


class AlreadyRunning(ReinforgeError):
    """Another process holds the pipeline's lock."""


def training_lock(output_dir: str | Path) -> Path:
    """The lock one training in `output_dir` holds: `.<name>.lock` beside it."""
    out = Path(output_dir)
    return out.parent / f".{out.name}.lock"


def pipeline_lock(output_dir: str | Path) -> Path:
    """The lock a pipeline (the nightly) holds around the trainings it runs in `output_dir`: never a training
    lock of any directory (those end in .lock), so a pipeline never waits on the training it started itself."""
    out = Path(output_dir)
    return out.parent / f".{out.name}.lock.pipeline"


def _take(fd: int, p: Path, what: str) -> None:
    """flock `fd` without waiting; AlreadyRunning naming the holder's pid if another process has it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        raise AlreadyRunning(
            f"{what} is already running (pid {holder}, lock {p}); this run exits without "
            "training. Wait for it to finish."
        ) from None


def check_free(path: str | Path, what: str) -> None:
    """AlreadyRunning now if another process holds the lock at `path` (nothing is created or written): the
    answer a command gives before it starts any service."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:  # no lock file: nobody holds it
        return
    try:
        _take(fd, p, what)
    finally:
        os.close(fd)  # and the probe's lock with it


@contextmanager
def exclusive(path: str | Path, what: str):
    """Hold an flock on `path` for the block; AlreadyRunning (naming the holder's pid) if taken."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _take(fd, p, what)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)
