"""How the driver reaches its workers: Ray actors (every run), or the very same worker objects in this process
(`LocalActor`), so the flow's logic (staleness, dynamic sampling, rebuilds) runs through the same typed groups
in a test that takes seconds.

A transport answers six questions the groups ask: wait for these calls, which of them failed because their
actor died (a collective fails on the survivors too), put a value where every worker can read it, what to do
with the actors of a call that hung, stop these actors, and which processes they run in.

The local transport is also a run's own (trainer.backend=local, components/training/local_workers.py).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import ray


def kill_tree(pid: int | None) -> None:
    """SIGKILL a process and every process it started (children first), and reap them."""
    import psutil

    if pid is None or not psutil.pid_exists(pid) or pid == os.getpid():
        return
    root = psutil.Process(pid)
    procs = root.children(recursive=True) + [root]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


class RayTransport:
    """Ray actors: calls are object refs, waited for with a timeout; a hung call's processes are killed."""

    timeout_error = ray.exceptions.GetTimeoutError
    task_error = ray.exceptions.RayTaskError

    def get(self, refs: list, timeout_s: float | None) -> list:
        return ray.get(refs, timeout=timeout_s)

    def death_among(self, refs: list, timeout_s: float = 30.0) -> Exception | None:
        """The error of the first of `refs` whose actor died (or is unreachable), as each finishes, waiting up
        to `timeout_s` in all for Ray to know it; None when none did."""
        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                return None
            try:
                ray.get(ready[0], timeout=0)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                return exc
            except Exception:  # noqa: BLE001 - this call's own failure: not a death
                continue
        return None

    def put(self, value):
        return ray.put(value)

    def stop_hung(self, pids: list[int]) -> str:
        """A call hung: its actors' processes are killed with every process they started."""
        for pid in pids:
            kill_tree(pid)
        return f"its processes (pids {pids}) and every process they started were killed"

    def pids(self, actors: list) -> list[int]:
        return ray.get([a.pid.remote() for a in actors])

    def kill(self, actors: list, pids: list[int]) -> None:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except ValueError:  # not an actor handle any more: nothing to kill
                pass


class _Never(Exception):
    """Never raised: a local call's own exception reaches the caller as it is."""


class _LocalTimeout(Exception):
    """A local call run in a thread of its own (ThreadedActor's) did not finish in time."""


class LocalTransport:
    """Worker objects in this process: a call runs when it is made, and its result is its own reference; a
    ThreadedActor's call runs in a thread, and its reference is a Future, waited for at most the timeout."""

    timeout_error = _LocalTimeout
    task_error = _Never

    def get(self, refs: list, timeout_s: float | None) -> list:
        futures = [r for r in refs if isinstance(r, Future)]
        if futures and wait_futures(futures, timeout_s).not_done:
            raise _LocalTimeout
        return [r.result() if isinstance(r, Future) else r for r in refs]

    def death_among(self, refs: list) -> None:
        return None

    def put(self, value):
        return value

    def stop_hung(self, pids: list[int]) -> str:
        """A call hung in this process: nothing can be killed; its thread is a daemon, left behind."""
        return "it runs in this process (trainer.backend=local), where its thread was left behind"

    def pids(self, actors: list) -> list[int]:
        return [os.getpid()] * len(actors)

    def kill(self, actors: list, pids: list[int]) -> None:
        pass


RAY, LOCAL = RayTransport(), LocalTransport()


class LocalActor:
    """A worker object called as a Ray actor is (`actor.method.remote(...)`, `.options(...)`), in this
    process: the call runs at once and answers its result."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self.obj, name))


class _LocalMethod:
    def __init__(self, fn):
        self.fn = fn

    def options(self, **_: object) -> _LocalMethod:  # Ray's placement and concurrency options: none here
        return self

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class ThreadedActor(LocalActor):
    """A LocalActor whose every call runs in a thread of its own, so that the caller's wait is bounded: the
    reward scorer's, whose reward functions are the user's code (one that hangs stops the run at
    trainer.stage_timeout_s, as on Ray). A daemon thread: one that hangs does not hold up the process's exit."""

    def __getattr__(self, name: str) -> _ThreadedMethod:
        return _ThreadedMethod(getattr(self.obj, name))


class _ThreadedMethod(_LocalMethod):
    def remote(self, *args, **kwargs) -> Future:
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(self.fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - the caller's wait raises it
                future.set_exception(exc)

        threading.Thread(target=run, name=f"local-{self.fn.__name__}", daemon=True).start()
        return future
