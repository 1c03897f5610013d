"""File locks: a training run holds its own run directory's (two runs never write one run), a pipeline (the
nightly) its own; the output directory's is held only while a run picks its run directory, so runs of one
output directory never block or refuse each other."""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path

from components.errors import ReinforgeError


class AlreadyRunning(ReinforgeError):
    """Another process holds the pipeline's lock."""


def training_lock(output_dir: str | Path) -> Path:
    """The lock a training holds while it picks its run directory in `output_dir`: `.<name>.lock` beside it."""
    out = Path(output_dir)
    return out.parent / f".{out.name}.lock"


def run_lock(run_dir: str | Path) -> Path:
    """The lock the training that writes `run_dir` (<output>/runs/<id>) holds: <output>/.locks/<id>.lock, out
    of the run directories (and of what DVC tracks)."""
    run = Path(run_dir)
    return run.parent.parent / ".locks" / f"{run.name}.lock"


def pipeline_lock(output_dir: str | Path) -> Path:
    """The lock a pipeline (the nightly) holds around the trainings it runs in `output_dir`: never a training
    lock of any directory (those end in .lock), so a pipeline never waits on the training it started itself."""
    out = Path(output_dir)
    return out.parent / f".{out.name}.lock.pipeline"


def _take(fd: int, p: Path, what: str, wait_s: float = 0.0) -> None:
    """flock `fd`, waiting up to `wait_s` for it; AlreadyRunning naming the holder's pid if another process
    still has it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    waited = f" for {wait_s:g} s" if wait_s else ""
    raise AlreadyRunning(
        f"{what} is already running (pid {holder}, lock {p}{waited}); this run exits without "
        "training. Wait for it to finish."
    ) from None


def is_held(path: str | Path) -> bool:
    """Whether another process holds the lock at `path` now (nothing is created or written)."""
    try:
        check_free(path, "")
    except AlreadyRunning:
        return True
    return False


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


class Held:
    """A lock this process holds until release() (or its exit: the kernel drops an flock with its file)."""

    def __init__(self, path: str | Path, what: str, wait_s: float = 0.0):
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _take(self.fd, p, what, wait_s)
        except BaseException:
            os.close(self.fd)
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_KEPT: dict[str, Held] = {}  # the locks this process keeps until it exits (keep()), by real path


def keep(path: str | Path, what: str) -> None:
    """Take the lock at `path` for the rest of this process (AlreadyRunning if another holds it): a command
    that answers "already running" before it starts any service, then runs the flow that takes the same
    lock. exclusive() on this path is then a no-op: a second flock of it from this process would refuse."""
    key = os.path.realpath(path)
    if key not in _KEPT:
        _KEPT[key] = Held(path, what)


@contextmanager
def exclusive(path: str | Path, what: str, wait_s: float = 0.0):
    """Hold an flock on `path` for the block, waiting up to `wait_s` for it; AlreadyRunning (naming the
    holder's pid) if it stays taken. Nothing to take when this process keeps it already (keep())."""
    if os.path.realpath(path) in _KEPT:
        yield
        return
    held = Held(path, what, wait_s)
    try:
        yield
    finally:
        held.release()
