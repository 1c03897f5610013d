"""Tracking and checkpoint tasks: what a run resumes, the MLflow run, per-iteration metrics, checkpoints, the final
model."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path

from components.algorithms.shaping import KLController
from components.batch import Batch
from components.config import Config, fingerprint
from components.config.loader import training_keys
from components.data.io import write_atomic
from components.data.sampler import PromptSampler
from components.env import dvc_experiment
from components.lineage import file_md5, model_digest, verify_tracked
from components.locking import Held, exclusive, is_held, run_lock, training_lock
from components.outputs import MODEL, TRAIN_OUTPUT, check_output, claim_output
from components.plan import RunPlan
from components.rewards.registry import scorers_for
from components.rollout.ahead import AheadQueue
from components.run import Run
from components.tracking import checkpoints, runs
from components.tracking.mlflow_tracker import Tracker, dataset_input, git_commit
from components.tracking.plots import plot_metrics, reward_curve, write_dvc_plots
from components.training.ray_workers import Workers
from tasks.common import logger, stage


def run_fingerprint(cfg: Config) -> runs.Fingerprint:
    """What a checkpoint must match to be resumed: the config's training keys, the training data's md5, the
    models the run starts from (the policy, and the critic's and reward model's when set) and the custom
    reward function's source."""
    inputs = {"train_data": file_md5(cfg.data.train_path)}
    for key, path in (
        ("actor.model.path", cfg.actor.model.path),
        ("critic.model_path", cfg.critic.model_path),
        ("reward_model.path", cfg.reward_model.path),
    ):
        if path:
            inputs[key] = model_digest(path)
    reward_file = cfg.custom_reward_function.path
    if reward_file:
        inputs["custom_reward_function.path"] = file_md5(reward_file) if Path(reward_file).is_file() else "-"
    config = json.loads(json.dumps(training_keys(cfg), default=str))  # as state.json will hold it
    return runs.Fingerprint(fingerprint(cfg, **inputs), config, inputs)


@stage(name="plan-resume")
def plan_resume(cfg: Config, fp: runs.Fingerprint) -> runs.ResumePlan:
    """Which run directory this training writes and which verified checkpoint it continues
    (components/tracking/runs.py), passing over a run another process trains now; a corrupt checkpoint is
    passed over, named in the log, for the last good one. Raises before anything is written when there is
    nothing to train."""
    t = cfg.trainer
    resume = runs.plan_run(
        *(t.output_dir, fp, t.resume_mode, t.iterations, t.resume_accept_mismatch, t.when_finished),
        busy=lambda run_dir: is_held(run_lock(run_dir)),
    )
    for note in resume.notes:
        logger().warning("resume: %s", note)
    if resume.checkpoint is not None:
        checkpoints.check_same_shapes(resume.checkpoint, cfg.actor.model.path)
        logger().warning(
            "resuming from %s%s",
            resume.checkpoint,
            f" (a finished run, extended to {t.iterations} iterations)" if resume.extends else "",
        )
    return resume


# how long a run waits for another to finish picking its run directory (reading run.json files and verifying
# their checkpoints: seconds), before it says which process holds the output directory
PICK_WAIT_S = 300.0


def take_run_dir(cfg: Config, fp: runs.Fingerprint) -> tuple[runs.ResumePlan, Held]:
    """This run's directory (plan_resume), created and locked for the run: the output directory's lock is held
    only while the run picks it, so runs of one output directory, finished or training, never block or refuse
    each other; two never write one run directory (a run directory in training is never continued)."""
    t = cfg.trainer
    output = check_output(t.output_dir, "trainer.output_dir", TRAIN_OUTPUT, t.run_dir)
    with exclusive(training_lock(output), f"a run picking its directory in {output}", wait_s=PICK_WAIT_S):
        resume = plan_resume(cfg, fp)  # refused (nothing to train): nothing written in the output directory
        claim_output(output, "trainer.output_dir", TRAIN_OUTPUT, t.run_dir)
        lock = Held(run_lock(resume.run_dir), f"a training run in {resume.run_dir}")
        resume.run_dir.mkdir(parents=True, exist_ok=True)
    return resume, lock


def prefect_run_tags() -> dict[str, str]:
    """The Prefect flow run this MLflow run belongs to (none outside one)."""
    from prefect.runtime import flow_run

    return {"prefect.flow_run_id": flow_run.id, "prefect.flow_run_name": flow_run.name} if flow_run.id else {}


@stage(name="start-run")
def start_run(
    cfg: Config,
    pipeline: str,
    version: str,
    run_name: str,
    resume: runs.ResumePlan,
    fp: runs.Fingerprint,
    params: dict,
) -> Tracker:
    """One MLflow run: params = flattened config; tags = git commit, data hashes, pipeline name/version.
    A resumed training continues its run (never renamed; steps it already has are never logged again); an
    extension of a finished run logs to a child of it, which stays as it finished. Writes the run directory's
    run.json."""
    hashes = verify_tracked([cfg.data.train_path, cfg.data.eval_path])
    parent = resume.parent_run_id
    tags = {
        # MLflow's own source tags: the run page links the commit and names the entry point
        "mlflow.source.git.commit": git_commit(),
        "mlflow.source.name": "reinforge train",
        "mlflow.source.type": "LOCAL",
        "reinforge.preset": cfg.algorithm.name,
        **prefect_run_tags(),
        "pipeline": pipeline or "adhoc",
        "pipeline_version": version or "",
        "dvc.train_md5": hashes[cfg.data.train_path],
        "dvc.eval_md5": hashes[cfg.data.eval_path],
        "reinforge.run_dir": str(resume.run_dir),
        # a DVC experiment's name and baseline: `dvc exp show` and MLflow's compare view name the same runs
        **{f"dvc.exp_{k}": v for k, v in dvc_experiment().items()},
    }
    if parent:
        run_name = f"{run_name}-extends-{parent[:8]}"
        tags.update(
            {"mlflow.parentRunId": parent, "reinforge.extends": f"{parent} at iteration {resume.extends}"}
        )
    tracker = Tracker(cfg.trainer.experiment_name, run_name, run_id=resume.mlflow_run_id)
    if resume.mlflow_run_id and tracker.run_id != resume.mlflow_run_id:
        logger().warning(
            "resume: MLflow run %s of the checkpoint is not in this tracking store; logging to a new run %s",
            resume.mlflow_run_id,
            tracker.run_id,
        )
    tracker.log_params(params)
    tracker.set_tags(tags if tracker.resumed else {**tags, "mlflow.runName": run_name})
    tracker.log_inputs(
        [
            dataset_input(cfg.data.train_path, "train", hashes[cfg.data.train_path]),
            dataset_input(cfg.data.eval_path, "eval", hashes[cfg.data.eval_path]),
        ]
    )
    if cfg.trainer.log_system_metrics:
        tracker.log_system_metrics(cfg.trainer.system_metrics_interval_s)
    runs.start_info(resume, fp, cfg.trainer.iterations, tracker.run_id)
    return tracker


@stage(name="save-checkpoint")
def save_checkpoint(
    workers: Workers,
    tracker: Tracker,
    cfg: Config,
    resume: runs.ResumePlan,
    iteration: int,
    state: dict,
    files: dict[str, bytes] | None = None,
) -> tuple[str, dict]:
    """Atomic checkpoint in the run's own directory (the policy worker's model, optimizer, scheduler, RNG and
    critic; the driver's `state`: sampler position, weights version, controller, run fingerprint; `files`:
    the driver's own files, such as the rollouts sampled ahead) logged to MLflow as an artifact. Returns its
    directory and its state.json (checkpoint_metrics reads the save's timing from it). The metrics queued so
    far are stored first: a checkpoint never gets ahead of its run's metrics."""
    tracker.flush()

    def write(out: Path) -> None:
        workers.policy.write_checkpoint(str(out), cfg.trainer.save_optimizer)
        for name, data in (files or {}).items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)

    path = checkpoints.save_checkpoint(
        resume.checkpoints,
        iteration,
        write,
        {
            **state,
            "mlflow_run_id": tracker.run_id,
            "seed": cfg.trainer.seed,
            "target_iterations": cfg.trainer.iterations,
        },
        keep=cfg.trainer.max_checkpoints_to_keep,
    )
    tracker.log_artifacts(path, f"checkpoints/{path.name}")
    return str(path), checkpoints.read_state(path)


def checkpoint_metrics(state: dict) -> dict[str, float]:
    """What a checkpoint's own state says about its save, logged at its iteration."""
    return {"timing_s/save_checkpoint": float(state.get("save_seconds", 0.0))}


@stage(name="log-samples")
def log_samples(tracker: Tracker, samples: list[dict], iteration: int, metrics: dict[str, float]) -> str:
    """A few held-out prompts with the model's greedy answers, rewards and ground truths, as a table of the
    MLflow run (samples/iter_NNNNNN/answers.json, with each image beside it for a VLM), and the evaluation
    as a Prefect table artifact of the flow run (its Artifacts tab). Returns the MLflow artifact folder."""
    folder = tracker.log_samples(samples, iteration)
    evaluation_artifact(iteration, metrics, samples)
    return folder


def _cell(value: object) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows])


def evaluation_artifact(iteration: int, metrics: dict[str, float], samples: list[dict]) -> None:
    """The evaluation at `iteration` as a markdown artifact of the flow run: its val/ metrics, then the
    sampled answers. Outside a flow run (a task's .fn() called directly) there is nothing to attach it to."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return
    from components.data.prompts import prompt_text

    vals = [[k, v] for k, v in sorted(metrics.items()) if k.startswith("val/")]
    answers = [
        [prompt_text(s["row"]["prompt"]), s["answer"], s["row"]["reward_model"]["ground_truth"], s["score"]]
        for s in samples
    ]
    create_markdown_artifact(
        f"## Evaluation at iteration {iteration}\n\n{markdown_table(['metric', 'value'], vals)}\n\n"
        f"### Greedy answers\n\n{markdown_table(['prompt', 'response', 'ground truth', 'reward'], answers)}\n",
        key="evaluation",
        description=f"held-out evaluation at iteration {iteration}",
    )


EPISODES = 4  # sampled multi-turn episodes traced at each evaluation


@stage(name="trace-episodes")
def trace_episodes(tracker: Tracker, batch: Batch, tokenizer, iteration: int) -> list[str]:
    """The first EPISODES multi-turn episodes of this iteration's rollout as MLflow traces: their prompt, each
    turn's text (the model's, the tool's) and their reward. Returns the trace ids."""
    from components.rollout.multi_turn import episode_turns

    t = batch.tensors
    episodes = []
    for i in range(min(EPISODES, len(batch))):
        response = t["responses"][i]
        turns = episode_turns(t["response_mask"][i], t["response_attention_mask"][i])
        prompt = t["prompts"][i][t["prompt_mask"][i].bool()]
        episodes.append(
            {
                "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
                "turns": [(role, tokenizer.decode(response[a:b])) for role, a, b in turns],
                "reward": float(t["scores"][i]),
                "ground_truth": str(batch.non_tensors["ground_truth"][i]),
            }
        )
    return tracker.log_episode_traces(episodes, iteration)


@stage(name="restore-checkpoint")
def restore_checkpoint(workers: Workers, ckpt: str) -> int:
    """Load a verified checkpoint into the policy worker; returns the weights version it holds."""
    return workers.policy.load_checkpoint(ckpt)


@stage(name="finalize")
def finalize(
    workers: Workers,
    tracker: Tracker,
    cfg: Config,
    resume: runs.ResumePlan,
    history: list[dict],
    wall_s: float,
) -> dict:
    """Save the final model in the run directory (HF format) and log it to MLflow as a model of its own
    (stored apart from the run's artifacts, so no later run ever writes its files); the reward curve and
    run.json; end the MLflow run. `latest` in trainer.output_dir names this run, and its final model is
    published as trainer.output_dir/final (what DVC tracks). Its own seconds are logged as
    timing_s/finalize: what of the time between the last step and the process's exit is this work."""
    began = time.perf_counter()
    final = workers.policy.save_model(str(resume.run_dir / "final"), MODEL)
    model_id = tracker.log_model(
        final,
        "final_model",
        model_config={
            "apply_chat_template": cfg.data.apply_chat_template,
            "trust_remote_code": cfg.actor.model.trust_remote_code,
        },
    )
    plot = reward_curve(history, resume.run_dir / "reward_curve.png")
    tracker.log_artifact(plot)
    # the run's whole series (a resumed run's earlier steps too) for dvc.yaml's plots
    write_dvc_plots(tracker.metric_series(plot_metrics()), Path(cfg.trainer.output_dir) / "plots")
    last_eval = next((h for h in reversed(history) if "val/acc" in h), {})
    info = runs.write_info(
        resume.run_dir,
        status="finished",
        final_model=final,
        model_id=model_id,
        final_val_acc=last_eval.get("val/acc"),
        wall_seconds=round(wall_s, 2),
        experiment=cfg.trainer.experiment_name,
        run_id=tracker.run_id,
    )
    tracker.log_artifact(resume.run_dir / runs.RUN_INFO)
    runs.publish_final(cfg.trainer.output_dir, final)
    write_atomic(
        Path(cfg.trainer.output_dir) / "latest", lambda tmp: Path(tmp).write_text(resume.run_dir.name + "\n")
    )
    tracker.log_summary({"timing_s/finalize": time.perf_counter() - began})
    tracker.end("FINISHED")
    return info


def finished_run_info(cfg: Config) -> dict:
    """run.json of this configuration's newest finished run (for evaluation)."""
    return runs.read_info(runs.finished_run(cfg.trainer.output_dir, run_fingerprint(cfg).digest))


def open_run(cfg: Config, plan: RunPlan, tokenizer, rows: tuple, pipeline: str, version: str) -> Run:
    """What this training continues (refusing, before anything is written, when there is nothing to train),
    its output directory and its MLflow run, named after what ran (the pipeline or the DVC experiment), the
    preset, the run's fingerprint and when."""
    train_rows, eval_rows = rows
    fingerprint = run_fingerprint(cfg)  # config, data, models, reward: what a checkpoint must match to resume
    # a data_source no scorer takes stops the run here, before its output is claimed or its MLflow run opened
    scorers = scorers_for([r["data_source"] for r in train_rows + eval_rows], cfg)
    resume, lock = take_run_dir(cfg, fingerprint)
    try:
        label = pipeline or dvc_experiment().get("name") or "train"
        run_name = f"{label}-{cfg.algorithm.name}-{fingerprint.digest[:10]}-{datetime.now(UTC):%m%d-%H%M}"
        tracker = start_run(cfg, pipeline, version, run_name, resume, fingerprint, plan.params)
    except BaseException:
        lock.release()
        raise
    return Run(
        *(cfg, plan, tokenizer, train_rows, eval_rows),
        scorers=scorers,
        resume=resume,
        fingerprint=fingerprint,
        tracker=tracker,
        sampler=PromptSampler(len(train_rows), plan.batch_size, plan.shuffle, plan.seed),
        kl_ctrl=KLController(*plan.kl_in_reward) if plan.kl_in_reward else None,
        ahead=AheadQueue(plan.ahead, plan.iterations),
        checkpoint=str(resume.checkpoint) if resume.checkpoint else None,
        state=resume.state,
        lock=lock,
    )
