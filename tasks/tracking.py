"""Tracking and checkpoint tasks: the MLflow run, per-iteration metrics, checkpoints, the final model."""

from __future__ import annotations

import json
from pathlib import Path

from components.config import Config, fingerprint, flatten
from components.data.io import write_json
from components.lineage import file_md5, model_digest, verify_tracked
from components.tracking import checkpoints
from components.tracking.mlflow_tracker import Tracker, git_commit
from components.tracking.plots import reward_curve
from components.training.ray_workers import Workers
from tasks.common import logger, stage


def run_fingerprint(cfg: Config) -> str:
    """The config's training keys, the training data's md5 and the models the run starts from (the policy,
    and the critic's and reward model's when set): what a checkpoint must match to be resumed."""
    models = {key: model_digest(path) for key, path in (("actor.model.path", cfg.actor.model.path),
                                                         ("critic.model_path", cfg.critic.model_path),
                                                         ("reward_model.path", cfg.reward_model.path)) if path}
    return fingerprint(cfg, train_data=file_md5(cfg.data.train_path), **models)


@stage(name="find-checkpoint")
def find_checkpoint(cfg: Config, fingerprint: str) -> tuple[str | None, dict]:
    """The checkpoint trainer.resume_mode asks for (verified) and its state.json; (None, {}) to start fresh.

    auto: the newest checkpoint under trainer.output_dir that verifies and was made with this config; a
    corrupted one is passed over (and named in the log) for the last good one. A path: that checkpoint,
    or CheckpointError naming the bad file."""
    mode = cfg.trainer.resume_mode
    if mode == "disable":
        return None, {}
    if mode == "auto":
        ckpt, skipped = checkpoints.find_resumable(Path(cfg.trainer.output_dir) / "checkpoints", fingerprint)
        for reason in skipped:
            logger().warning("resume: passed over a checkpoint: %s", reason)
    else:
        ckpt = Path(mode)
        checkpoints.verify(ckpt)
    if ckpt is None:
        return None, {}
    logger().warning("resuming from %s", ckpt)
    return str(ckpt), json.loads((ckpt / "state.json").read_text())


@stage(name="start-run")
def start_run(cfg: Config, pipeline: str, version: str, run_name: str, run_id: str | None = None) -> Tracker:
    """One MLflow run: params = flattened config; tags = git commit, data hashes, pipeline name/version.
    With run_id (a resumed training) the same run continues; steps it already has are never logged again."""
    hashes = verify_tracked([cfg.data.train_path, cfg.data.eval_path])
    tracker = Tracker(cfg.trainer.experiment_name, run_name, run_id=run_id)
    tracker.log_params(flatten(cfg))
    tracker.set_tags({"git_commit": git_commit(), "pipeline": pipeline or "adhoc", "pipeline_version": version or "",
                      "dvc.train_md5": hashes[cfg.data.train_path], "dvc.eval_md5": hashes[cfg.data.eval_path],
                      "mlflow.runName": run_name})
    return tracker


def log_metrics(tracker: Tracker, metrics: dict[str, float], step: int) -> bool:
    """Queue an iteration's metrics for MLflow (stored in the background; save_checkpoint and finalize wait for
    them). A plain call, not a task: it only queues, and each task run costs the Prefect server ~20 ms of CPU."""
    return tracker.log_metrics(metrics, step)


@stage(name="save-checkpoint")
def save_checkpoint(workers: Workers, tracker: Tracker, cfg: Config, iteration: int, state: dict) -> tuple[str, dict]:
    """Atomic checkpoint (the policy worker's model, optimizer, scheduler, RNG and critic; the driver's
    `state`: sampler position, weights version, controller, run fingerprint) logged to MLflow as an artifact. Returns its
    directory and its state.json (checkpoint_metrics reads the save's timing from it). The metrics queued
    so far are stored first: a checkpoint never gets ahead of its run's metrics."""
    tracker.flush()
    path = checkpoints.save_checkpoint(
        Path(cfg.trainer.output_dir) / "checkpoints", iteration,
        lambda out: workers.call("policy", "write_checkpoint", str(out), cfg.trainer.save_optimizer),
        {**state, "mlflow_run_id": tracker.run_id, "seed": cfg.trainer.seed},
        keep=cfg.trainer.max_checkpoints_to_keep)
    tracker.log_artifacts(path, f"checkpoints/{path.name}")
    return str(path), json.loads((path / "state.json").read_text())


def checkpoint_metrics(state: dict) -> dict[str, float]:
    """What a checkpoint's own state says about its save, logged at its iteration."""
    return {"timing_s/save_checkpoint": float(state.get("save_seconds", 0.0))}


@stage(name="restore-checkpoint")
def restore_checkpoint(workers: Workers, ckpt: str) -> int:
    """Load a verified checkpoint into the policy worker; returns the weights version it holds."""
    return workers.call("policy", "load_checkpoint", ckpt)


@stage(name="finalize")
def finalize(workers: Workers, tracker: Tracker, cfg: Config, history: list[dict], wall_s: float) -> dict:
    """Save the final model (HF format), the reward curve and run.json; end the MLflow run."""
    out = Path(cfg.trainer.output_dir)
    final = workers.call("policy", "save_model", str(out / "final"))
    tracker.log_artifacts(final, "final_model")
    plot = reward_curve(history, out / "reward_curve.png")
    tracker.log_artifact(plot)
    last_eval = next((h for h in reversed(history) if "val/acc" in h), {})
    info = {"run_id": tracker.run_id, "iterations": cfg.trainer.iterations, "wall_seconds": round(wall_s, 2),
            "final_model": final, "final_val_acc": last_eval.get("val/acc"), "experiment": cfg.trainer.experiment_name}
    write_json(info, out / "run.json")
    tracker.log_artifact(out / "run.json")
    tracker.end("FINISHED")
    return info


def read_run_info(output_dir: str | Path) -> dict:
    p = Path(output_dir) / "run.json"
    return json.loads(p.read_text()) if p.is_file() else {}
