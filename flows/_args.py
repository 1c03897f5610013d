"""Command-line plumbing shared by every flow's `python -m flows.X` entry point."""

from __future__ import annotations

import argparse
import json
import os
import sys

from components.errors import ReinforgeError

DEFAULT_CONFIG = "configs/arith_grpo.yaml"
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
    for child in psutil.Process().children():
        try:
            cmd = " ".join(child.cmdline())
            if "uvicorn" in cmd and "prefect" in cmd:
                if child.nice() < niceness:
                    child.nice(niceness)
                return child.pid
        except psutil.Error:  # gone, or not ours to change
            continue
    return None


def config_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config file (default: %(default)s)")
    p.add_argument("overrides", nargs="*", help="config overrides as key=value, e.g. algorithm.beta=0.1")
    return p


def check_config(path: str, overrides: list[str]) -> int:
    """Validate the config before any flow (or Prefect server) starts: 0 when good, 2 with the message."""
    from components.config import load_config

    try:
        load_config(path, overrides)
    except ReinforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def run_cli(fn, *args, **kwargs) -> int:
    """Run a flow; a ReinforgeError prints its message (no traceback) and exits 2."""
    try:
        result = fn(*args, **kwargs)
    except ReinforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result is not None:
        print(json.dumps(result, indent=2, default=str))
    return 0
