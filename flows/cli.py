"""The `reinforge` command: one subcommand per stage, each with its own --help (flows/parsers.py)."""

from __future__ import annotations

import argparse
import importlib
import sys

from flows.parsers import COMMANDS

# the commands that run Prefect flows
RUN_FLOWS = ("prepare", "clean", "data", "sft", "train", "evaluate", "reward-model", "nightly")
RUN_RAY = ("train", "nightly")  # those whose workers are Ray actors (unless trainer.backend=local)


def start_ray_checking_config(args: argparse.Namespace) -> int:
    """Check the config (importing the modules the flow needs, while Prefect's server starts), then start Ray
    here when the run's workers are Ray actors: its init must run in the main thread. A bad config fails
    before Ray starts. Returns the check's exit code: 2 when the config is bad (its error printed), 0 when
    good."""
    from components.config.names import RAY_BACKENDS
    from flows._args import checked_config

    failed, cfg = checked_config(args.config, args.overrides, args.debug)
    if not failed and cfg.trainer.backend in RAY_BACKENDS:
        from components.errors import ReinforgeError
        from components.training.cluster import ensure_ray
        from flows._args import report

        try:  # one run per process: its actors take the warmed workers
            ensure_ray(warm_workers=True, start_timeout_s=cfg.trainer.ray_start_timeout_s)
        except ReinforgeError as exc:  # Ray did not start (a busy machine): one line
            return report(exc, args.debug)
    return failed


def given_inputs(args: argparse.Namespace) -> int:
    """What a flow command was given that is wrong before anything is read: a key given twice among its
    overrides, a line break in a value, this checkout's auth file empty or altered. 0, or 2 with the line."""
    from components.config.loader import check_given
    from components.env import check_auth
    from components.errors import ReinforgeError
    from flows._args import report

    try:
        check_auth()
        check_given(getattr(args, "overrides", None) or [])
    except ReinforgeError as exc:
        return report(exc, getattr(args, "debug", False))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from reinforge import __version__

        print(f"reinforge {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        p = argparse.ArgumentParser(
            prog="reinforge", description="RL post-training for LLMs as a Prefect/DVC DAG."
        )
        p.add_argument("-V", "--version", action="store_true", help="print the version and exit")
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
    args = parser().parse_args(argv[1:])
    if argv[0] not in RUN_FLOWS:
        return importlib.import_module(module).main(extra + argv[1:])
    from components.shutdown import install_signal_handlers

    # Ctrl-C or SIGTERM from here on is one line and exit 130/143, not a KeyboardInterrupt traceback from
    # whichever import (pydantic's, torch's) it lands in during the seconds before the flow runs
    install_signal_handlers()
    from components.gc_pause import collector_paused, freeze_for_exit

    if failed := given_inputs(args):  # a repeated key, a bad auth file: said before any service starts
        return failed
    if argv[0] in RUN_RAY:  # another run in its output directory, or not ours to write: say so before
        from flows._args import free_to_train  # any service starts

        pipeline = "nightly" if argv[0] == "nightly" else None  # the name nightly_flow's lock gives
        if failed := free_to_train(args.config, args.overrides, pipeline, args.debug):
            return failed
    with collector_paused():  # the imports and the services' start: objects the whole run keeps
        from components.services import start_prefect_server_early

        start_prefect_server_early()  # Prefect's server comes up while the flow's modules are imported
        failed = start_ray_checking_config(args) if argv[0] in RUN_RAY else 0
        flow_module = None if failed else importlib.import_module(module)
    if flow_module is None:
        return failed
    try:
        return flow_module.main(extra + argv[1:])
    finally:
        freeze_for_exit()
        if argv[0] in RUN_RAY:
            from components.training.cluster import stop_ray

            stop_ray()


if __name__ == "__main__":
    sys.exit(main())
