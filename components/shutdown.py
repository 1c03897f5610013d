"""Stopping a run at once and cleanly: on Ctrl-C or SIGTERM, or when a service it depends on has died.

What a run has started registers a cleanup step (`on_stop`): the MLflow run is marked KILLED, the Ray workers are
stopped. `stop()` runs those steps within a few seconds, kills every process this one started (Prefect's
in-process server, the local Ray cluster and its workers), prints one line saying what happened and how to
resume, and exits without waiting on anything else: Prefect's clients would otherwise retry a dead server
for minutes, and its event queue drain for hours.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

STEP_TIMEOUT_S = 4.0  # each cleanup step; the whole stop stays within about 15 s
_steps: list[tuple[str, Callable[[], None]]] = []
_where: dict[str, str] = {}
_stopping = threading.Lock()


@contextmanager
def on_stop(name: str, step: Callable[[], None]):
    """Run `step` if the process is stopped while the block runs (newest steps first)."""
    entry = (name, step)
    _steps.append(entry)
    try:
        yield
    finally:
        if entry in _steps:
            _steps.remove(entry)


def note(**facts: str) -> None:
    """What the run is doing, for the stop message: iteration=..., checkpoint=..., resume=..."""
    _where.update({k: v for k, v in facts.items() if v})


def _run_bounded(step: Callable[[], None]) -> None:
    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    thread.join(STEP_TIMEOUT_S)


def kill_descendants(timeout_s: float = 3.0) -> None:
    """SIGKILL every process this one started, and theirs."""
    import psutil

    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)


def stopping() -> bool:
    """Whether stop() is under way (a run failing meanwhile was stopped, not broken)."""
    return _stopping.locked()


def wait_if_stopping() -> None:
    """Called by the main thread on its way out: while stop() runs in another thread, leave the exit to it."""
    while stopping():
        time.sleep(1)


def _silence() -> int:
    """Send stdout and stderr (Python's and the C libraries') to /dev/null; returns a copy of the real stderr.
    While a run is being stopped its libraries report the abandoned stage's errors: the one line of stop() is
    what the user needs."""
    logging.disable(logging.CRITICAL)
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    return saved


def stop(reason: str, code: int) -> None:
    """Clean up (bounded), kill our descendants, print `reason` with where the run was and how to resume, exit
    with `code`. A second call (a second Ctrl-C) while stopping waits for the first."""
    if not _stopping.acquire(blocking=False):
        while True:
            time.sleep(1)
    stderr = _silence()
    for _, step in reversed(list(_steps)):
        _run_bounded(step)
    kill_descendants()
    where = f" at {_where['iteration']}" if "iteration" in _where else ""
    resume = _where.get("resume", "Run the same command again.")
    os.write(stderr, f"error: {reason}{where}; every process it started is stopped. {resume}\n".encode())
    os._exit(code)


def _handler(signum, _frame) -> None:
    name = signal.Signals(signum).name
    threading.Thread(target=stop, args=(f"interrupted ({name})", 128 + signum), daemon=True).start()


def install_signal_handlers() -> None:
    """Ctrl-C (SIGINT) and SIGTERM stop the process through stop(): exit codes 130 and 143."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handler)


def reclaim_signals() -> None:
    """Put our handlers back after a library replaced them (ray.init sets a SIGTERM handler that calls
    sys.exit, which Prefect then reports as a crash after minutes of retries), when they were installed."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _handler:
        signal.signal(signal.SIGTERM, _handler)
