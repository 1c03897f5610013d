"""What a flow run's logs say, in the terminal and in the Prefect UI's Logs tab.

- A run that fails on a user's error (a ReinforgeError: a bad key, file, row or model directory) shows it as one
  line, `error: ...`, logged by the flow itself; Prefect's own records of that failure (tracebacks, "Finished in
  state Failed(...ConfigError...)") are dropped. The CLI prints that line itself, so its terminal drops it too.
- Prefect's line for each task run that completed as expected ("Finished in state Completed()") is dropped: a
  100-iteration run has thousands, and they bury the per-iteration lines. Failed, crashed and cached ones stay.
"""

from __future__ import annotations

import functools
import logging
import re

from components.errors import OutputError, ReinforgeError, no_space

OWN = "reinforge_user_error"  # set on the one record a flow logs of a user's error
# the loggers whose handlers write a run's records: the terminal (root), the Prefect API (flow and task runs)
CONSOLE, RUN_LOGGERS = "", ("prefect.flow_runs", "prefect.task_runs")


def _subclasses(cls: type) -> list[type]:
    return [cls] + [s for sub in cls.__subclasses__() for s in _subclasses(sub)]


def about_user_error(record: logging.LogRecord) -> bool:
    """Whether Prefect's record is about a run that failed on a ReinforgeError: it carries one, or names one."""
    if record.exc_info and isinstance(record.exc_info[1], ReinforgeError):
        return True
    names = "|".join(cls.__name__ for cls in _subclasses(ReinforgeError))
    return re.search(rf"\b({names})\b", record.getMessage()) is not None


class UserErrors(logging.Filter):
    """Drops Prefect's records of a user's error; keeps the flow's own line unless `keep_own` is False."""

    def __init__(self, keep_own: bool = True):
        super().__init__()
        self.keep_own = keep_own

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, OWN, False):
            return self.keep_own
        return not about_user_error(record)


class RoutineLines(logging.Filter):
    """Drops the line Prefect logs for every task run that completed."""

    def filter(self, record: logging.LogRecord) -> bool:
        routine = record.name == "prefect.task_runs" and record.levelno <= logging.INFO
        return not (routine and record.getMessage().startswith("Finished in state Completed("))


def _add_once(handler: logging.Handler, new: logging.Filter) -> None:
    if not any(type(f) is type(new) for f in handler.filters):
        handler.addFilter(new)


def install(keep_own_on_console: bool = True) -> None:
    """The filters on the handlers Prefect set up (idempotent: a handler that has one keeps it, so the CLI,
    which installs first with keep_own_on_console=False, keeps its terminal free of the line it prints)."""
    for name in (CONSOLE, *RUN_LOGGERS):
        for handler in logging.getLogger(name).handlers:
            _add_once(handler, UserErrors(keep_own_on_console if name == CONSOLE else True))
            _add_once(handler, RoutineLines())


def one_line_errors(fn):
    """A flow function whose user errors are one line in its run's logs (and in a serving or worker
    process's terminal), not Prefect's tracebacks; the error is raised on, so the run still fails."""

    @functools.wraps(fn)
    def flow_fn(*args, **kwargs):
        from tasks.common import logger

        install()
        try:
            return fn(*args, **kwargs)
        except ReinforgeError as exc:
            logger().error("error: %s", exc, extra={OWN: True})
            raise
        except Exception as exc:
            full = no_space(exc)
            if full is None:
                raise
            error = full_disk(full)
            logger().error("error: %s", error, extra={OWN: True})
            raise error from None

    return flow_fn


def full_disk(exc: BaseException) -> OutputError:
    """A full disk met anywhere in a flow (a checkpoint names its own directory and sizes) as one line."""
    where = getattr(exc, "filename", None)
    on = f" writing {where}" if where else ""
    said = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    return OutputError(
        f"no space left on a disk this run writes to{on} ({said}). Free space there, or move the outputs "
        "(trainer.output_dir, sft.output_dir, data.*) to a disk with room; finished checkpoints are kept, so "
        "the same command then resumes."
    )
