"""Shared task settings: which failures are transient (the flow rebuilds its workers on them), the default
stage timeout, and `stage`, the decorator of the RL loop's tasks."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from prefect import Task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import opaque

# Stages pass tensors and Ray handles, which are not worth hashing for a cache key.
STAGE = {"cache_policy": NO_CACHE, "timeout_seconds": 1800}


class Stage(Task):
    """A Prefect task whose arguments are passed `opaque`: Prefect still links a value an upstream task
    returned (the graph in the UI), but does not walk into it looking for futures. A batch, a config and the
    worker handles are thousands of nodes; walking them cost 15-35 ms per call, more than the work of some
    stages (bench/trl_compare.py)."""

    def __call__(self, *args: Any, return_state: bool = False, wait_for: Any = None, **kwargs: Any) -> Any:
        return super().__call__(
            *(opaque(a) for a in args),
            return_state=return_state,
            wait_for=wait_for,
            **{k: opaque(v) for k, v in kwargs.items()},
        )

    def submit(self, *args: Any, return_state: bool = False, wait_for: Any = None, **kwargs: Any) -> Any:
        """The same, run in the flow's task runner (a future); an upstream future passed as an argument is
        still resolved (its result, once it has one), the rest passed opaque. Without a Prefect timeout: it
        cannot interrupt the runner's thread (and warns on every run); the Ray calls inside have theirs."""
        from prefect.futures import PrefectFuture

        wrap = lambda v: v if isinstance(v, PrefectFuture) else opaque(v)  # noqa: E731
        untimed = copy.copy(self)
        untimed.timeout_seconds = None
        return Task.submit(
            untimed,
            *(wrap(a) for a in args),
            return_state=return_state,
            wait_for=wait_for,
            **{k: wrap(v) for k, v in kwargs.items()},
        )


# The RL iteration a stage's run belongs to, set by the flow around each iteration's tasks (and around the
# rollouts it samples ahead for a later one): the UI names the task runs `gen[it=12]`, `update-actor[it=12]`
ITERATION: ContextVar[int | None] = ContextVar("reinforge_iteration", default=None)


@contextmanager
def for_iteration(it: int) -> Iterator[None]:
    """The stages run (or submitted) inside this block belong to iteration `it`: their run names say so."""
    token = ITERATION.set(it)
    try:
        yield
    finally:
        ITERATION.reset(token)


def _run_name(name: str):
    def run_name() -> str:
        it = ITERATION.get()
        return name if it is None else f"{name}[it={it}]"

    return run_name


def stage(**options: Any):
    """@stage(name=..., retries=...): a Stage task with STAGE's defaults (no cache, a timeout) under options;
    its runs are named after the iteration they belong to (for_iteration)."""
    if "name" in options and "task_run_name" not in options:
        options["task_run_name"] = _run_name(options["name"])
    return lambda fn: Stage(fn=fn, **{**STAGE, **options})


TRANSIENT = (
    "RayActorError",
    "ActorDiedError",
    "ActorUnavailableError",
    "WorkerCrashedError",
    "ObjectLostError",
    "GetTimeoutError",
    "TimeoutError",
    "ConnectionError",
)


def is_transient(exc: BaseException) -> bool:
    """A failure of the machinery (the exception or one of its base classes is named in TRANSIENT)."""
    return any(cls.__name__ in TRANSIENT for cls in type(exc).__mro__)


def logger():
    """The run logger inside a flow or task run; a plain logger when a task's .fn() is called directly."""
    import logging

    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("reinforge")
