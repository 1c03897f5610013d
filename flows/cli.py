"""The `reinforge` command: one subcommand per stage, each with --help."""

from __future__ import annotations

import argparse
import sys

# subcommand -> (module, help, extra argv inserted before the user's)
COMMANDS = {
    "prepare": ("flows.data", "generate (or import GSM8K) raw data", ["--step", "prepare"]),
    "clean": ("flows.data", "validate rows; quarantine bad ones with a reason", ["--step", "clean"]),
    "data": ("flows.data", "prepare then clean", []),
    "sft": ("flows.sft", "supervised warm start", []),
    "train": ("flows.train", "RL training (GRPO by default) on Ray, tracked in MLflow", []),
    "evaluate": ("flows.evaluate", "held-out accuracy of the SFT and final models (metrics/eval.json)", []),
    "generate": ("flows.generate", "sample completions from a model", []),
    "reward-model": ("flows.reward_model", "train a tiny reward model on arithmetic preference pairs", []),
    "nightly": ("flows.nightly", "data, train, evaluate, register if better", []),
    "deploy": ("flows.deploy_cli", "turn pipelines.yaml into Prefect deployments", []),
    "convert": ("flows.convert", "Hugging Face model <-> sharded model or checkpoint (model merger)", []),
    "config": (
        "flows.config_cli",
        "the full reference config (generate), a config as it resolves (show)",
        [],
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        p = argparse.ArgumentParser(
            prog="reinforge", description="RL post-training for LLMs as a Prefect/DVC DAG."
        )
        sub = p.add_subparsers(dest="command", metavar="COMMAND")
        for name, (_, help_, _) in COMMANDS.items():
            sub.add_parser(name, help=help_, add_help=False)
        if argv and argv[0] not in ("-h", "--help"):
            p.error(f"unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}")
        p.print_help()
        return 0 if argv else 2
    import importlib

    module, _, extra = COMMANDS[argv[0]]
    entry = importlib.import_module(module).main
    return entry(extra + argv[1:])


if __name__ == "__main__":
    sys.exit(main())
