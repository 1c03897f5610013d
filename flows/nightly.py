"""Nightly retraining: data -> (sft if missing) -> train -> evaluate -> register if better.

One nightly at a time: a second run started meanwhile exits saying which process holds the lock.
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow, task

from components.config import load_config
from components.locking import exclusive
from components.tracking.registry import register_if_better
from flows._args import check_config, config_parser, run_cli
from flows.data import data_flow
from flows.evaluate import evaluate_flow
from flows.sft import sft_flow
from flows.train import train_flow
from tasks.common import STAGE


@task(name="register-model", **STAGE)
def register(name: str, run_id: str, acc: float) -> dict:
    return register_if_better(name, run_id, "final_model", acc)


@flow(name="rl-nightly")
def nightly_flow(config: str = "configs/arith_grpo.yaml", overrides: list[str] | None = None,
                 model_name: str = "reinforge-arith", pipeline: str = "nightly", pipeline_version: str = "") -> dict:
    overrides = overrides or []
    cfg = load_config(config, overrides)
    with exclusive(Path(cfg.trainer.output_dir).parent / ".nightly.lock", f"pipeline {pipeline}"):
        data_flow(config, overrides)
        if not (Path(cfg.sft.output_dir) / "config.json").is_file():
            sft_flow(config, overrides)
        info = train_flow(config, overrides, pipeline, pipeline_version)
        results = evaluate_flow(config, overrides, str(Path(cfg.trainer.output_dir) / "eval.json"))
        reg = register(model_name, info["run_id"], results["final"]["acc"])
    return {"train": info, "eval": results, "registry": reg}


def main(argv: list[str] | None = None) -> int:
    p = config_parser("Nightly retraining: data, train, evaluate, register the model if it is better.")
    p.add_argument("--model-name", default="reinforge-arith", help="MLflow registered model name")
    a = p.parse_args(argv)
    return check_config(a.config, a.overrides) or run_cli(nightly_flow, a.config, a.overrides, a.model_name)


if __name__ == "__main__":
    sys.exit(main())
