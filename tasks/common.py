"""Shared task settings: which failures are transient (retried) and the default stage timeout."""

from __future__ import annotations

from prefect.cache_policies import NO_CACHE

# Stages pass tensors and Ray handles, which are not worth hashing for a cache key.
STAGE = {"cache_policy": NO_CACHE, "timeout_seconds": 1800}

TRANSIENT = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError", "ObjectLostError",
             "GetTimeoutError", "TimeoutError", "ConnectionError")
# retries of a stage whose Ray actor died: Ray restarts it meanwhile (a second or two)
RETRY_TRANSIENT = {"retries": 3, "retry_delay_seconds": [1, 3, 10]}


def retry_transient(task, task_run, state) -> bool:
    """Retry only failures of the machinery (a dead worker, a timeout), never our own errors."""
    try:
        state.result()
    except Exception as exc:  # the failed state re-raises the task's exception
        return is_transient(exc)
    return False


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
