"""The `reinforge` command: one subcommand per stage, each with its own --help (flows/parsers.py)."""

from __future__ import annotations

import argparse
import importlib
import sys

from flows.parsers import COMMANDS

# the commands that run Prefect flows
RUN_FLOWS = ("prepare", "clean", "data", "sft", "train", "evaluate", "reward-model", "nightly")
RUN_RAY = ("train", "nightly")  # those whose workers are Ray actors


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        p = argparse.ArgumentParser(
            prog="reinforge", description="RL post-training for LLMs as a Prefect/DVC DAG."
        )
        sub = p.add_subparsers(dest="command", metavar="COMMAND")
        for name, (_, _, help_, _) in COMMANDS.items():
            sub.add_parser(name, help=help_, add_help=False)
        if argv and argv[0] not in ("-h", "--help"):
            p.error(f"unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}")
        p.print_help()
        return 0 if argv else 2
    parser, module, _, extra = COMMANDS[argv[0]]
    # --help, and options the command does not take, are answered here, before the flow's module imports
    # Prefect, Ray and torch; the flow parses the same arguments again with the same parser
    parser().parse_args(argv[1:])
    if argv[0] in RUN_FLOWS:  # Prefect's server comes up while the flow's modules are imported
        from components.services import start_prefect_server_early

        start_prefect_server_early()
    if argv[0] in RUN_RAY:  # and Ray (its init must run in this, the main, thread): ~2 s of waiting on
        from components.training.cluster import ensure_ray  # its processes while the server's thread imports

        ensure_ray()
    return importlib.import_module(module).main(extra + argv[1:])


if __name__ == "__main__":
    sys.exit(main())
