"""Command-line plumbing shared by every flow's `python -m flows.X` entry point."""

from __future__ import annotations

import argparse
import json
import sys

from components.errors import ReinforgeError

DEFAULT_CONFIG = "configs/arith_grpo.yaml"


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
