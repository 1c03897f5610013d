"""Shared task settings: which failures are transient (retried) and the default stage timeout."""

from __future__ import annotations

from prefect.cache_policies import NO_CACHE

# Stages pass tensors and Ray handles, which are not worth hashing for a cache key.
STAGE = {"cache_policy": NO_CACHE, "timeout_seconds": 1800}

TRANSIENT = ("RayActorError", "ActorDiedError", "WorkerCrashedError", "ObjectLostError", "GetTimeoutError",
             "TimeoutError", "ConnectionError")


def retry_transient(task, task_run, state) -> bool:
    """Retry only failures of the machinery (a dead worker, a timeout), never our own errors."""
    try:
        state.result()
    except Exception as exc:  # the failed state re-raises the task's exception
        return type(exc).__name__ in TRANSIENT
    return False


def logger():
    """The run logger inside a flow or task run; a plain logger when a task's .fn() is called directly."""
    import logging

    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("reinforge")
