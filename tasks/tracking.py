"""Tracking and checkpoint tasks: the MLflow run, per-iteration metrics, checkpoints, the final model."""

from __future__ import annotations

import json
from pathlib import Path

import ray
from prefect import task

from components.config import Config, flatten
from components.data.io import write_json
from components.lineage import verify_tracked
from components.tracking import checkpoints
from components.tracking.mlflow_tracker import Tracker, git_commit
from components.tracking.plots import reward_curve
from components.training.ray_workers import Workers
from tasks.common import STAGE


@task(name="start-run", **STAGE)
def start_run(cfg: Config, pipeline: str, version: str, run_name: str) -> Tracker:
    """One MLflow run: params = flattened config; tags = git commit, data hashes, pipeline name/version."""
    hashes = verify_tracked([cfg.data.train_path, cfg.data.eval_path])
    tracker = Tracker(cfg.trainer.experiment_name, run_name)
    tracker.log_params(flatten(cfg))
    tracker.set_tags({"git_commit": git_commit(), "pipeline": pipeline or "adhoc", "pipeline_version": version or "",
                      "dvc.train_md5": hashes[cfg.data.train_path], "dvc.eval_md5": hashes[cfg.data.eval_path],
                      "mlflow.runName": run_name})
    return tracker


@task(name="log-metrics", retries=2, retry_delay_seconds=[1, 5], **STAGE)
def log_metrics(tracker: Tracker, metrics: dict[str, float], step: int) -> bool:
    return tracker.log_metrics(metrics, step)


@task(name="save-checkpoint", **STAGE)
def save_checkpoint(workers: Workers, tracker: Tracker, cfg: Config, iteration: int, sampler_state: dict,
                    version: int) -> str:
    """Atomic checkpoint (model, optional optimizer, state, manifest) logged to MLflow as an artifact."""
    opt = ray.get(workers.policy.optimizer_state.remote()) if cfg.trainer.save_optimizer else None
    path = checkpoints.save_checkpoint(
        Path(cfg.trainer.output_dir) / "checkpoints", iteration,
        lambda out: ray.get(workers.policy.save_model.remote(str(out))),
        {"sampler": sampler_state, "weights_version": version, "mlflow_run_id": tracker.run_id,
         "seed": cfg.trainer.seed}, opt)
    tracker.log_artifacts(path, f"checkpoints/{path.name}")
    return str(path)


@task(name="finalize", **STAGE)
def finalize(workers: Workers, tracker: Tracker, cfg: Config, history: list[dict], wall_s: float) -> dict:
    """Save the final model (HF format), the reward curve and run.json; end the MLflow run."""
    out = Path(cfg.trainer.output_dir)
    final = ray.get(workers.policy.save_model.remote(str(out / "final")))
    tracker.log_artifacts(final, "final_model")
    plot = reward_curve(history, out / "reward_curve.png")
    tracker.log_artifact(plot)
    last_eval = next((h for h in reversed(history) if "val/acc" in h), {})
    info = {"run_id": tracker.run_id, "iterations": len(history), "wall_seconds": round(wall_s, 2),
            "final_model": final, "final_val_acc": last_eval.get("val/acc"), "experiment": cfg.trainer.experiment_name}
    write_json(info, out / "run.json")
    tracker.log_artifact(out / "run.json")
    tracker.end("FINISHED")
    return info


def read_run_info(output_dir: str | Path) -> dict:
    p = Path(output_dir) / "run.json"
    return json.loads(p.read_text()) if p.is_file() else {}
