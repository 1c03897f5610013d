"""Every command's argument parser, in one module that imports nothing but argparse: `reinforge X --help`
(and a mistyped option) answers at once, before the flow's module imports Prefect, Ray, MLflow and torch
(several seconds on a small machine). The flows parse their arguments with these same parsers."""

from __future__ import annotations

import argparse
from collections.abc import Callable

DEFAULT_CONFIG = "configs/arith_grpo.yaml"


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the argument, with exit code 2 (argparse's own
    prints its usage first)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def number(kind: type, low: float, high: float, what: str) -> Callable[[str], float]:
    """An argparse type: a finite `kind` (int or float) in [low, high]; its error says the range and why."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a{'n integer' if kind is int else ' number'}"
            ) from None
        if value != value or value in (float("inf"), float("-inf")) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is outside {low:g}..{high:g} ({what})")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def config_parser(prog: str, description: str, cls: type[Parser] = Parser) -> argparse.ArgumentParser:
    """A stage that reads a config: --config, --debug, --json and key=value overrides."""
    p = cls(prog=prog, description=description)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config file (default: %(default)s)")
    p.add_argument(
        "--debug", action="store_true", help="show the traceback of an error, not only its message"
    )
    p.add_argument(
        "--json", action="store_true", help="print the stage's result as JSON (default: a short summary)"
    )
    p.add_argument("overrides", nargs="*", help="config overrides as key=value, e.g. algorithm.beta=0.1")
    return p


def _data(prog: str, description: str, step: bool) -> argparse.ArgumentParser:
    p = config_parser(prog, description)
    if step:  # `reinforge prepare` and `reinforge clean` are the steps; `python -m flows.data` picks one
        p.add_argument(
            "--step", choices=["prepare", "clean", "all"], default="all", help="(default: %(default)s)"
        )
    return p


def prepare() -> argparse.ArgumentParser:
    return _data(
        "reinforge prepare",
        "Generate the raw datasets (or import GSM8K / LLaVA files) into data/raw, in verl's row format.",
        step=False,
    )


def clean() -> argparse.ArgumentParser:
    return _data(
        "reinforge clean",
        "Validate the raw rows into data/clean; rows that fail go to data/quarantine with the reason.",
        step=False,
    )


def data() -> argparse.ArgumentParser:
    return _data("reinforge data", "Prepare, then clean, the datasets.", step=True)


def sft() -> argparse.ArgumentParser:
    return config_parser(
        "reinforge sft",
        "Supervised warm start: build the tiny model (or load sft.base_model) and fine-tune it.",
    )


def train() -> argparse.ArgumentParser:
    return config_parser(
        "reinforge train",
        "Run GRPO (or another preset) on the SFT model; metrics and checkpoints go to MLflow.",
    )


class _Evaluate(Parser):
    """`reinforge evaluate`: --model_path needs --eval_data, said before any import."""

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if parsed.model_path and not parsed.eval_data:
            self.error("--model_path needs --eval_data FILE (a held-out parquet or jsonl)")
        return parsed


def evaluate() -> argparse.ArgumentParser:
    p = config_parser(
        "reinforge evaluate", "Evaluate held-out accuracy (greedy acc, mean@k, pass@k).", cls=_Evaluate
    )
    p.add_argument("--model_path", help="evaluate this model directory alone (needs --eval_data)")
    p.add_argument("--eval_data", help="held-out parquet/jsonl: required with --model_path")
    p.add_argument(
        "--output",
        help="the JSON file the metrics go to (default: metrics/eval.json for the SFT-vs-final comparison; "
        "none with --model_path, which prints them)",
    )
    return p


def generate() -> argparse.ArgumentParser:
    p = Parser(prog="reinforge generate", description="Sample completions from a local model.")
    p.add_argument(
        "prompts",
        nargs="+",
        help="prompt texts, e.g. '12+34=' (with --messages: JSON lists of chat messages)",
    )
    p.add_argument(
        "--messages", action="store_true", help="each prompt is a JSON list of {role, content} messages"
    )
    p.add_argument(
        "--apply-chat-template",
        choices=["true", "false"],
        default=None,
        help="render prompts through the chat template (default: messages yes, plain strings no, as "
        "data.apply_chat_template)",
    )
    p.add_argument(
        "--model_path",
        default="checkpoints/grpo",
        help="HF model directory, a peft adapter directory, or a training output directory (its last "
        "finished run's final model)",
    )
    p.add_argument(
        "-n", type=number(int, 1, 1024, "completions per prompt"), default=1, help="completions per prompt"
    )
    p.add_argument(
        "--temperature",
        type=number(float, 0, 100, "0 is greedy; a negative one would invert the distribution"),
        default=0.0,
        help="0 = greedy",
    )
    p.add_argument(
        "--max_new_tokens",
        type=number(int, 1, 65536, "tokens generated per completion"),
        default=16,
    )
    p.add_argument("--seed", type=number(int, 0, 2**32 - 1, "a 32-bit seed"), default=0)
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model directory's own Python code (its auto_map), as actor.model.trust_remote_code",
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


def reward_model() -> argparse.ArgumentParser:
    p = config_parser(
        "reinforge reward-model",
        "Train a reward model on preference pairs from the arithmetic task (right answer vs a "
        "near miss), starting from the SFT model; then train with reward_model.path=<out>.",
    )
    p.add_argument(
        "--out", default="checkpoints/rm", help="where the reward model is saved (default: %(default)s)"
    )
    p.add_argument(
        "--steps",
        type=number(int, 1, 10**7, "optimizer steps"),
        default=150,
        help="optimizer steps (default: %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=number(int, 1, 65536, "pairs per step"),
        default=64,
        help="pairs per step (default: %(default)s)",
    )
    p.add_argument(
        "--lr",
        type=number(float, 1e-12, 10, "a learning rate"),
        default=3e-4,
        help="AdamW learning rate (default: %(default)s)",
    )
    return p


def nightly() -> argparse.ArgumentParser:
    p = config_parser(
        "reinforge nightly",
        "Nightly retraining: data, train, evaluate, register the model if it is better.",
    )
    p.add_argument("--model-name", default="reinforge-arith", help="MLflow registered model name")
    return p


def deploy() -> argparse.ArgumentParser:
    p = Parser(
        prog="reinforge deploy",
        description="Turn pipelines.yaml into Prefect deployments. "
        "Default: register them and serve them from this process (needs a Prefect server: "
        "`prefect server start`, then `prefect deployment run 'rl-train/arith-grpo'`).",
    )
    p.add_argument("--file", default="pipelines.yaml", help="pipelines file")
    p.add_argument("--only", nargs="*", help="pipeline names to deploy (default: all)")
    p.add_argument("--apply", action="store_true", help="register the deployments and exit (no serving)")
    p.add_argument("--work-pool", help="deploy to this Prefect work pool instead of serving in-process")
    p.add_argument(
        "--source",
        help="with --work-pool: the git repository (URL) the pool's workers clone the code from, so a worker on "
        "another machine runs this commit's code (default: this checkout's directory, for a worker here)",
    )
    p.add_argument("--branch", help="with --source: the branch to clone (default: the repository's)")
    p.add_argument(
        "--write-prefect-yaml",
        action="store_true",
        help="write Prefect's own deployment file (prefect.yaml, for `prefect deploy --all`) and exit",
    )
    return p


def convert() -> argparse.ArgumentParser:
    p = Parser(
        prog="reinforge convert",
        description="Split a Hugging Face model into the shards of a worker mesh (--to sharded), or merge a "
        "sharded model or sharded checkpoint back into a Hugging Face directory (--to hf); a round trip is "
        "bit-identical.",
    )
    p.add_argument("--to", choices=["sharded", "hf"], required=True, help="the format to write")
    p.add_argument(
        "--source",
        required=True,
        help="--to sharded: a Hugging Face model directory; --to hf: a sharded model directory, or a "
        "checkpoint (iter_NNNNNN) written with trainer.checkpoint_format=sharded",
    )
    p.add_argument("--out", required=True, help="the directory to write (new, or empty)")
    p.add_argument(
        "--tensor-parallel",
        type=number(int, 1, 1024, "workers"),
        default=1,
        help="--to sharded: TP workers per replica",
    )
    p.add_argument(
        "--data-parallel", type=number(int, 1, 1024, "workers"), default=1, help="--to sharded: FSDP replicas"
    )
    return p


def config() -> argparse.ArgumentParser:
    p = Parser(
        prog="reinforge config",
        description="The full reference config (generate), or a config as it resolves (show).",
    )
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    gen = sub.add_parser(
        "generate",
        prog="reinforge config generate",
        help="the full reference config, every key with its default and help",
    )
    gen.add_argument("--out", help="write it here (default: print it)")
    show = sub.add_parser(
        "show", prog="reinforge config show", help="a config as it resolves, each value with its source"
    )
    show.add_argument("--config", help="the config file (default: none, the defaults alone)")
    show.add_argument("overrides", nargs="*", help="key=value overrides, as every stage takes them")
    show.add_argument("--debug", action="store_true", help="a traceback with an error")
    return p


def diagnose() -> argparse.ArgumentParser:
    p = Parser(
        prog="reinforge diagnose",
        description="One report of what this machine (and the clusters the environment names) can run: "
        "each line a check with ok / warn / fail and the fix. Exit 0 when nothing fails, 1 otherwise.",
    )
    p.add_argument(
        "--device", action="store_true", help="also the accelerators: GPUs, NCCL, bf16, NPUs, TPUs"
    )
    p.add_argument("--config", help="also whether this config fits this machine (mesh, engine, memory)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of --config")
    p.add_argument("--json", action="store_true", help="the checks as JSON (for CI)")
    return p


def ui() -> argparse.ArgumentParser:
    p = Parser(
        prog="reinforge ui",
        description="The MLflow UI on this checkout's tracking store (or MLFLOW_TRACKING_URI's server), with "
        "the link that opens the experiment on its runs table. Ctrl-C stops it.",
    )
    p.add_argument("--experiment", default="reinforge", help="the experiment to open (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    p.add_argument(
        "--port", type=number(int, 1, 65535, "a TCP port"), default=5000, help="(default: %(default)s)"
    )
    return p


# subcommand -> (its parser, the module whose main runs it, the help line, argv put before the user's)
COMMANDS: dict[str, tuple[Callable[[], argparse.ArgumentParser], str, str, list[str]]] = {
    "prepare": (prepare, "flows.data", "generate (or import GSM8K) raw data", ["--step", "prepare"]),
    "clean": (clean, "flows.data", "validate rows; quarantine bad ones with a reason", ["--step", "clean"]),
    "data": (data, "flows.data", "prepare then clean", []),
    "sft": (sft, "flows.sft", "supervised warm start", []),
    "train": (train, "flows.train", "RL training (GRPO by default) on Ray, tracked in MLflow", []),
    "evaluate": (
        evaluate,
        "flows.evaluate",
        "held-out accuracy of the SFT and final models (metrics/eval.json)",
        [],
    ),
    "generate": (generate, "flows.generate", "sample completions from a model", []),
    "reward-model": (
        reward_model,
        "flows.reward_model",
        "train a tiny reward model on arithmetic preference pairs",
        [],
    ),
    "nightly": (nightly, "flows.nightly", "data, train, evaluate, register if better", []),
    "deploy": (deploy, "flows.deploy_cli", "turn pipelines.yaml into Prefect deployments", []),
    "convert": (
        convert,
        "flows.convert",
        "Hugging Face model <-> sharded model or checkpoint (model merger)",
        [],
    ),
    "config": (
        config,
        "flows.config_cli",
        "the full reference config (generate), a config as it resolves (show)",
        [],
    ),
    "ui": (ui, "flows.ui", "the MLflow UI on the project's runs, opened on the runs table", []),
    "diagnose": (
        diagnose,
        "flows.diagnose",
        "what this machine and the configured clusters can run, with fixes",
        [],
    ),
}
