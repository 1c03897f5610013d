"""Nightly retraining: data -> (sft if missing) -> train -> evaluate -> register, promoted if better.

One nightly at a time: a second run started meanwhile exits saying which process holds the lock. A crashed
nightly's run is continued by the next one; a finished one is trained again as a new run
(trainer.when_finished=retrain). Every model is registered as a version of its own (an MLflow logged model);
it takes the alias `champion` when its held-out accuracy beats the champion's on the same evaluation set, else
`challenger`.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from components.config import Config
from components.lineage import file_md5
from components.locking import exclusive, pipeline_lock
from components.tracking.registry import CHAMPION, download_version, register_candidate
from components.validate import load_checked
from flows import parsers
from flows._args import check_config, run_cli
from flows._logs import one_line_errors
from flows.data import data_flow
from flows.evaluate import evaluate_flow
from flows.notifications import announce_not_promoted, crash_abandoned, tag_of
from flows.sft import sft_flow
from flows.train import train_flow
from tasks.common import STAGE, logger
from tasks.evaluate import evaluate_model
from tasks.tracking import markdown_table


@task(name="register-model", **STAGE)
def register(cfg: Config, name: str, info: dict, acc: float) -> dict:
    """A new version of `name` for this run's logged model, with its alias decided against the champion
    (measured again on this evaluation set when the champion's figure is from another one)."""
    eval_set = f"{file_md5(cfg.data.eval_path)}:{cfg.trainer.eval_size or 'all'}"

    def measure(version: str) -> float:
        with tempfile.TemporaryDirectory(prefix="champion-") as tmp:
            path = download_version(name, version, tmp)
            return evaluate_model.fn(
                str(path), cfg.data.eval_path, cfg, f"{name} v{version}", "data.eval_path"
            )["acc"]

    decision = register_candidate(name, info["model_id"], info["run_id"], acc, eval_set, measure)
    logger().info(
        "registry: %s v%s -> %s (%s)", name, decision["version"], decision["alias"], decision["reason"]
    )
    if decision["alias"] != CHAMPION:  # a pipeline's `not_promoted` automation tells a person
        announce_not_promoted(decision)
    create_markdown_artifact(  # the flow run's Artifacts tab: what was decided, and why
        f"## {name} v{decision['version']}: {decision['alias']}\n\n"
        + markdown_table(["", ""], [[k, v] for k, v in decision.items()] + [["held-out acc", acc]]),
        key="promotion",
        description=f"registry decision for {name}",
    )
    return decision


@flow(name="rl-nightly")
@one_line_errors
def nightly_flow(
    config: str = "configs/arith_grpo.yaml",
    overrides: list[str] | None = None,
    model_name: str = "reinforge-arith",
    pipeline: str = "nightly",
    pipeline_version: str = "",
) -> dict:
    """Nightly retraining: data, train, evaluate, then register the model: alias `champion` if it is better.

    Args:
        config: the YAML config file (configs/*.yaml), relative to the project.
        overrides: config overrides as key=value, e.g. ["algorithm.kl_loss_coef=0.04"].
        model_name: the MLflow registered model the better model becomes a version of.
        pipeline: the pipeline's name (pipelines.yaml), recorded on the MLflow run.
        pipeline_version: the pipeline's version, recorded on the MLflow run.
    """
    # a finished run is trained again; CPU, memory, disk and network use (system/*) are recorded unless the
    # overrides say otherwise (they come after these defaults)
    overrides = ["trainer.log_system_metrics=true", *(overrides or []), "trainer.when_finished=retrain"]
    cfg = load_checked(config, overrides)
    with exclusive(pipeline_lock(cfg.trainer.output_dir), f"pipeline {pipeline}"):
        for name in crash_abandoned(pipeline):
            logger().warning(
                "flow run %s of pipeline %s was left Running by a dead process: Crashed", name, pipeline
            )
        data_flow(config, overrides)
        if not (Path(cfg.sft.output_dir) / "config.json").is_file():
            sft_flow(config, overrides)
        info = train_flow(config, overrides, pipeline, pipeline_version)
        results = evaluate_flow(config, overrides, str(Path(info["final_model"]).parent / "eval.json"))
        reg = register(cfg, model_name, info, results["final"]["acc"])
    return {"train": info, "eval": results, "registry": reg}


def main(argv: list[str] | None = None) -> int:
    from prefect import tags

    a = parsers.nightly().parse_args(argv)
    if check_config(a.config, a.overrides, a.debug):
        return 2
    with tags(tag_of("nightly")):  # as its deployment's runs are: the pipeline's notifications hold for it
        return run_cli(nightly_flow, a.config, a.overrides, a.model_name, debug=a.debug, as_json=a.json)


if __name__ == "__main__":
    sys.exit(main())
