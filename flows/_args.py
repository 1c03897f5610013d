"""Command-line plumbing shared by every flow's `python -m flows.X` entry point."""

from __future__ import annotations

import json
import os
import sys
import traceback

from components.errors import ReinforgeError
from components.services import check_run_services, prefect_server_pid, prefect_server_started
from flows import _logs

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


def checked_config(path: str, overrides: list[str], debug: bool = False):
    """Validate the config, the custom reward function and the services it names before any flow (or Prefect
    server) starts: (0, the config) when good, (2, None) with the message printed."""
    from components.config.loader import check_given
    from components.envs.agent import check_agent
    from components.rewards.custom import check_custom_reward
    from components.validate import load_checked

    try:
        cfg = load_checked(path, check_given(overrides))
        check_custom_reward(cfg)
        check_agent(cfg)
        check_run_services(cfg)
    except ReinforgeError as exc:
        return report(exc, debug), None
    return 0, cfg


def free_to_train(path: str, overrides: list[str], pipeline: str | None, debug: bool = False) -> int:
    """Before Prefect's server or Ray starts (a fraction of a second, no torch): the config parses, the training
    output directory is ours to write, and, for a pipeline, this process takes the pipeline's lock and keeps
    it to its exit (of two nightlies started together, one trains and the other exits here, starting
    nothing; a training never waits on another: each has a run directory of its own, components/locking.py).
    0 when free; 2 with the one line printed. The overrides were checked as given already (flows.cli)."""
    from components.config.loader import load_config
    from components.locking import keep, pipeline_lock
    from components.outputs import TRAIN_OUTPUT, check_output

    try:
        cfg = load_config(path, overrides)
        t = cfg.trainer
        output = check_output(t.output_dir, "trainer.output_dir", TRAIN_OUTPUT, t.run_dir)
        if pipeline is not None:
            keep(pipeline_lock(output), f"pipeline {pipeline}")
    except ReinforgeError as exc:
        return report(exc, debug)
    return 0


def check_config(path: str, overrides: list[str], debug: bool = False) -> int:
    """checked_config's exit code: 0 when good, 2 with the message printed."""
    return checked_config(path, overrides, debug)[0]


TIMESTAMPS = ("created", "started", "finished")  # seconds since the epoch in a result, shown as a date


def _shown(key: str, value: object) -> str:
    if key.rsplit(".", 1)[-1] in TIMESTAMPS and isinstance(value, int | float):
        from datetime import datetime

        return datetime.fromtimestamp(value).astimezone().isoformat(timespec="seconds")
    return str(round(value, 4)) if isinstance(value, float) else str(value)


SHOWN_NESTED = 10  # a nested dict of at most this many entries is shown (an evaluation); larger ones are data


def _scalars(result: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in result.items():
        if isinstance(value, dict):
            if len(value) <= SHOWN_NESTED:
                out += _scalars(value, f"{prefix}{key}.")
        elif not isinstance(value, list | tuple):
            out.append((f"{prefix}{key}", value))
        elif len(value) <= SHOWN_NESTED and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):  # the clean stage's report of each file
                out += _scalars(item, f"{prefix}{key}[{i}].")
        elif len(value) <= SHOWN_NESTED and not any(isinstance(v, dict | list | tuple) for v in value):
            out.append((f"{prefix}{key}", ", ".join(map(str, value))))  # the files a stage wrote
    return out


def summary(result: object) -> str:
    """A stage's result for a person: its scalars, those of small nested dicts by their dotted key
    (`final.acc`) and of short lists (`clean[0].kept`, the files written), a line each, timestamps as dates
    (long lists and large dicts are behind --json)."""
    if not isinstance(result, dict):
        return str(result)
    scalars = _scalars(result)
    width = max((len(k) for k, _ in scalars), default=0)
    return "\n".join(f"  {k:<{width}}  {_shown(k, v)}" for k, v in scalars)


def run_cli(fn, *args, debug: bool = False, as_json: bool = False, **kwargs) -> int:
    """Run a flow; a ReinforgeError prints its message once (no traceback unless `debug`) and exits 2. Ctrl-C
    or SIGTERM stops it at once (components/shutdown.py): nothing it started is left running. The result
    is printed as a short summary, or whole as JSON with `as_json` (--json)."""
    from components.shutdown import install_signal_handlers, wait_if_stopping

    install_signal_handlers()
    if not debug:  # the error is printed once, below: the terminal gets no copy of it from Prefect's logs
        _logs.install(keep_own_on_console=False)
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
