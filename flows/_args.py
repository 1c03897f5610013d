"""Command-line plumbing shared by every flow's `python -m flows.X` entry point."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import traceback

from components.errors import ReinforgeError
from components.services import check_services, prefect_server_pid, prefect_server_started

SERVER_NICE_ENV = "REINFORGE_PREFECT_SERVER_NICE"  # niceness of Prefect's in-process server; 0 = leave it


def yield_prefect_server(niceness: int | None = None) -> int | None:
    """Run Prefect's in-process API server (its ephemeral server: a child process of this one) at a lower CPU
    priority. It records every task run's states into SQLite, about 20 ms of CPU per task run; on a small
    machine it otherwise takes a core's slices from the torch threads of the workers, which then wait on
    each other (bench/trl_compare.py: W1 0.56 -> 0.24 s per step on 2 cores). At lower priority it does the
    same work in the gaps. A server the user runs (PREFECT_API_URL) is not ours and is left alone.
    Returns the server's pid, or None when there is no such child."""
    import psutil

    niceness = int(os.environ.get(SERVER_NICE_ENV, "19")) if niceness is None else niceness
    if niceness <= 0:
        return None
    pid = prefect_server_pid()
    if pid is None:
        return None
    try:
        server = psutil.Process(pid)
        if server.nice() < niceness:
            server.nice(niceness)
    except psutil.Error:  # gone, or not ours to change
        return None
    return pid


def report(exc: ReinforgeError, debug: bool = False) -> int:
    """A user's error as one line on stderr (its traceback too with --debug); the exit code 2."""
    if debug:
        traceback.print_exception(exc)
    print(f"error: {exc}", file=sys.stderr)
    return 2


def check_config(path: str, overrides: list[str], debug: bool = False) -> int:
    """Validate the config, the custom reward function and the services it names before any flow (or Prefect
    server) starts: 0 when good, 2 with the message."""
    from components.config import load_config
    from components.rewards.custom import check_custom_reward

    try:
        cfg = load_config(path, overrides)
        check_custom_reward(cfg)
        check_services(cfg.trainer.connect_timeout_s)
    except ReinforgeError as exc:
        return report(exc, debug)
    return 0


class _UserErrorFilter(logging.Filter):
    """Drops Prefect's console records of a run that failed on one of our errors (its traceback, and the
    'Finished in state Failed(... ConfigError ...)' lines): the CLI prints that error once, as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if record.exc_info and isinstance(record.exc_info[1], ReinforgeError):
            return False
        names = "|".join(cls.__name__ for cls in _subclasses(ReinforgeError))
        return re.search(rf"\b({names})\b", record.getMessage()) is None


def _subclasses(cls: type) -> list[type]:
    return [cls] + [s for sub in cls.__subclasses__() for s in _subclasses(sub)]


def quiet_user_errors() -> None:
    """Install _UserErrorFilter on the console handlers Prefect set up (the root logger's)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _UserErrorFilter) for f in handler.filters):
            handler.addFilter(_UserErrorFilter())


def summary(result: object) -> str:
    """A stage's result for a person: its top-level scalars, a line each (nested parts are behind --json)."""
    if not isinstance(result, dict):
        return str(result)
    lines = []
    for key, value in result.items():
        if isinstance(value, dict | list | tuple):
            continue
        shown = str(round(value, 4)) if isinstance(value, float) else str(value)
        lines.append(f"  {key:<16} {shown}")
    return "\n".join(lines)


def run_cli(fn, *args, debug: bool = False, as_json: bool = False, **kwargs) -> int:
    """Run a flow; a ReinforgeError prints its message once (no traceback unless `debug`) and exits 2. Ctrl-C
    or SIGTERM stops it at once (components/shutdown.py): nothing it started is left running. The result
    is printed as a short summary, or whole as JSON with `as_json` (--json)."""
    from components.shutdown import install_signal_handlers, wait_if_stopping

    install_signal_handlers()
    if not debug:
        quiet_user_errors()
    try:
        prefect_server_started()  # when `reinforge` started it while the flow's modules were imported
        result = fn(*args, **kwargs)
    except ReinforgeError as exc:
        wait_if_stopping()
        return report(exc, debug)
    except BaseException:
        wait_if_stopping()  # a run being stopped fails on its way: the stop owns the exit and its message
        raise
    if result is not None:
        print(json.dumps(result, indent=2, default=str) if as_json else summary(result))
    return 0
