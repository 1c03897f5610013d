"""The RL training flow: it only puts the stages in order (docs/architecture.md lists them hop by hop).

One iteration: gen -> reward -> [old_log_prob/ref/values] -> adv -> [update_critic] -> update_actor (and the
weight sync) -> testing -> checkpoint, each a task (tasks/rl.py, tasks/tracking.py) over the run plan made once
from the config. `collect` is generation and rewards, repeated by DAPO's dynamic sampling; `recover` is what
happens when a worker dies. Asynchronous modes (trainer.async_mode) sample the next iterations ahead, beside
the update (components/rollout/ahead.py).
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

from prefect import flow

from components.plan import make_plan
from components.progress import Timer, console, iteration_line, progress_bar, resume_hint, startup_metrics
from components.rewards.registry import scorer_names
from components.rl import zero_reward_warning
from components.rollout.staleness import overlap_seconds, staleness_metrics, within_bound
from components.run import Run
from components.services import PrefectWatch
from components.shutdown import note, on_stop, stopping
from components.tracking import checkpoints
from components.validate import load_checked
from flows import parsers
from flows._args import check_config, run_cli, yield_prefect_server
from flows._logs import one_line_errors
from tasks.common import for_iteration, is_transient, logger
from tasks.data import load_datasets
from tasks.rl import (
    StartingWorkers,
    check_inputs,
    compute_advantages,
    evaluate_policy,
    generate_rollouts,
    keep_informative,
    prepare_batch,
    score_rewards,
    sync_weights,
    update_critic,
    update_policy,
)
from tasks.tracking import (
    checkpoint_metrics,
    finalize,
    log_samples,
    open_run,
    restore_checkpoint,
    save_checkpoint,
    trace_episodes,
)


def sample_ahead(run: Run, it: int) -> tuple:
    """Submit iteration it's gen and reward tasks, with the weights the engine holds now: futures that run
    beside the update. Its task runs are named after the iteration they sample for."""
    rows = run.next_rows()
    with for_iteration(it):
        gen = generate_rollouts.submit(run.workers, rows, run.plan, it, run.version)
        return gen, score_rewards.submit(gen, run.tokenizer, run.plan, run.workers, run.scorers)


def take_ahead(run: Run, timer: Timer) -> tuple:
    """This iteration's rollout from those sampled ahead (the next ones submitted first, to sample beside this
    update), its samples older than trainer.max_staleness dropped (sampled again now, when none is left)."""
    run.ahead.fill(run.iteration, partial(sample_ahead, run), time.perf_counter)
    with timer.timed("wait_rollout"):
        mine = run.ahead.take(run.iteration)
        batch, metrics = mine.result()
    if (window := mine.gen_window()) is not None:
        timer.add("gen", window[1] - window[0])
        timer.add("gen_compute", batch.meta.get("gen_seconds", 0.0))
    kept, dropped = within_bound(batch, run.version, run.plan.max_staleness)
    if not len(kept):  # all too old: a fresh rollout with the weights the engine holds now
        kept, metrics = collect(run, timer)
    elif run.plan.algorithm.dynamic_sampling:
        kept, metrics = collect(run, timer, first=(kept, metrics))
    return kept, {**metrics, **staleness_metrics(kept, run.version, dropped)}


def push_after_ahead(run: Run, train_start: float) -> dict[str, float]:
    """The update's weights into the engine once the rollouts sampling with the previous weights are done
    (with partial rollouts at once, between two decode steps); timing_s/overlap is the seconds of this
    iteration's training that rollouts sampled beside."""
    windows = run.ahead.windows(time.perf_counter(), wait=not run.workers.rollout.mid_rollout)
    now = time.perf_counter()
    run.version = sync_weights(run.workers)
    return {
        "timing_s/overlap": overlap_seconds(windows, (train_start, now)),
        "timing_s/update_weights": time.perf_counter() - now,
    }


def collect(run: Run, timer: Timer, first: tuple | None = None) -> tuple:
    """gen + reward; with dynamic sampling, more rounds until data.batch_size informative groups are kept
    (after `first`, a scored round sampled ahead, when given)."""
    plan = run.plan

    def one_round(round_: int):
        rows = run.next_rows()
        with timer.timed("gen"):
            batch = generate_rollouts(run.workers, rows, plan, run.iteration, run.version, round_)
        timer.add("gen_compute", batch.meta.get("gen_seconds", 0.0))  # the rollout worker's own part
        with timer.timed("reward"):
            return score_rewards(batch, run.tokenizer, plan, run.workers, run.scorers)

    batch, metrics = first or one_round(0)
    if not plan.algorithm.dynamic_sampling:
        return batch, metrics
    rounds = [batch]
    kept, groups = keep_informative(rounds, plan.batch_size)
    while groups < plan.batch_size and len(rounds) < plan.max_gen_rounds:
        rounds.append(one_round(len(rounds))[0])
        kept, groups = keep_informative(rounds, plan.batch_size)
    rounds_metrics = {"dynamic_sampling/groups_kept": groups, "dynamic_sampling/gen_rounds": len(rounds)}
    return kept, {**metrics, **{k: float(v) for k, v in rounds_metrics.items()}}


def rollout(run: Run, timer: Timer) -> tuple:
    """This iteration's scored rollout: reused when the workers were rebuilt mid-iteration (each sample is
    scored once), else sampled ahead or now."""
    if run.scored is not None and run.scored[0] == run.iteration:
        _, batch, metrics, sampler_state = run.scored
        run.sampler.load_state_dict(sampler_state)
        return batch, metrics
    batch, metrics = take_ahead(run, timer) if run.plan.async_mode != "sync" else collect(run, timer)
    run.scored = (run.iteration, batch, metrics, run.sampler.state_dict())
    return batch, metrics


def iteration(run: Run) -> dict[str, float]:
    """One RL iteration; returns its metrics (logged, and checkpointed when due)."""
    plan, workers, timer, it = run.plan, run.workers, Timer(), run.iteration
    startup = startup_metrics({**run.marks, "first_gen": time.time()}) if run.marks else {}
    run.marks = {}
    batch, m_reward = rollout(run, timer)
    train_start = time.perf_counter()
    if plan.algorithm.needs_critic or plan.policy.need_old or workers.reference is not None:
        batch, t_prep = prepare_batch(workers, batch)
        timer.seconds.update(t_prep)
    with timer.timed("adv"):
        batch, m_adv = compute_advantages(batch, plan, run.kl_ctrl.value if run.kl_ctrl else None)
    if run.kl_ctrl is not None:
        run.kl_ctrl.update(m_adv["actor/reward_kl_penalty"], len(batch))
    m_critic = {}
    if plan.algorithm.needs_critic:
        with timer.timed("update_critic"):
            m_critic = update_critic(workers, batch)
    if plan.async_mode == "sync":
        m_actor, run.version = update_policy(workers, batch)  # its own timing_s/update_actor, _weights
    else:
        m_actor = {**update_policy(workers, batch, push=False)[0], **push_after_ahead(run, train_start)}
    metrics = {
        **m_reward,
        **m_adv,
        **m_critic,
        **m_actor,
        "workers/policy": float(len(workers.policy.actors)),
    }
    if it % plan.test_interval == 0 or it == plan.iterations:
        samples: list[dict] = []
        with timer.timed("testing"):
            metrics.update(evaluate_policy(workers, run.eval_rows, plan, run.tokenizer, run.scorers, samples))
        run.stop_if_prefect_died()  # before the evaluation's artifact, a call the dead server would stall
        log_samples(run.tracker, samples, it, metrics)  # a few held-out prompts, the model's answers
        if plan.rollout.multi_turn is not None:  # and a few of this iteration's episodes, turn by turn
            trace_episodes(run.tracker, batch, run.tokenizer, it)
    metrics.update({**timer.metrics(), **startup})
    # queued (stored in the background; the checkpoint waits for them) before the checkpoint: a crash between
    # the two re-runs `it`
    run.tracker.log_metrics(metrics, it)
    if it % plan.save_interval == 0 or it == plan.iterations:  # `it`, whose metrics are not re-logged
        run.checkpoint, run.state = save_checkpoint(
            workers, run.tracker, run.cfg, run.resume, it, run.driver_state(), run.ahead.files()
        )
        run.tracker.log_metrics(checkpoint_metrics(run.state), it)
        metrics.update(checkpoint_metrics(run.state))
    return metrics


def restore(run: Run) -> None:
    """Fresh workers into the last checkpoint's state (or the start when there is none): the policy worker's
    weights, optimizer and RNG, then the engine, the sampler, the controller and the rollouts sampled ahead."""
    run.sampler.load_state_dict(
        run.state.get("sampler", {**run.sampler.state_dict(), "epoch": 0, "cursor": 0})
    )
    if run.kl_ctrl is not None:
        run.kl_ctrl.load_state_dict(run.state.get("kl_ctrl", {"value": run.kl_ctrl.start}))
    run.ahead.clear()  # sampled by workers that are gone, or by none yet: a checkpoint's are restored below
    if run.checkpoint is None:
        run.version, run.iteration = 0, 1
        return
    restore_checkpoint(run.workers, run.checkpoint)
    run.ahead.restore(Path(run.checkpoint))
    if run.state.get("mlflow_run_id") == run.tracker.run_id:  # its own run: if killed before this was logged
        run.tracker.log_metrics(checkpoint_metrics(run.state), run.state["iteration"])
    run.version, run.iteration = sync_weights(run.workers), run.state["iteration"] + 1


def recover(run: Run, exc: Exception, rebuilds: int) -> int:
    """A worker died for good (a policy actor is never restarted by Ray, a hung call was killed, its node was
    lost): new workers from this run's last checkpoint (or its start), then on from there; steps already
    logged stay once. A rebuild that fails the same way (a lost node's resources still counted until Ray
    marks it dead) is tried again; any other error, or more than trainer.max_worker_rebuilds, ends the run.
    Returns the rebuilds made so far."""
    while True:
        if not is_transient(exc) or rebuilds > run.plan.max_worker_rebuilds:
            raise exc
        logger().warning(
            "iteration %d: a worker died (%s); rebuilding from the last checkpoint (%d/%d)",
            *(run.iteration, type(exc).__name__, rebuilds, run.plan.max_worker_rebuilds),
        )
        run.stop_workers()
        try:
            run.workers = run.start_workers(run.plan)
            break
        except Exception as again:  # noqa: BLE001 - judged at the top: transient, or the end of the run
            exc, rebuilds = again, rebuilds + 1
    if run.plan.async_mode != "sync":  # the checkpoint's rollouts sampled ahead replace those in flight, and
        run.scored = None  # the iteration's own is among them (or sampled again): the sampler stays in step
    if run.checkpoint is not None:
        checkpoints.verify(Path(run.checkpoint))
    restore(run)
    return rebuilds


def train(run: Run, starting: StartingWorkers, started: float) -> dict:
    """Take the started workers, restore, run the iterations (recovering from dead workers), save the final
    model."""
    from prefect.runtime import flow_run

    total, rebuilds = run.plan.iterations, 0
    run.watch = PrefectWatch(flow_run_id=flow_run.id)
    run.marks = {**run.marks, "setup": time.time()} if run.marks else {}
    run.workers = starting.take()
    restore(run)
    run.marks = {**run.marks, "workers": time.time()} if run.marks else {}
    with progress_bar(run.cfg.algorithm.name, total - run.iteration + 1, run.cfg.trainer.progress) as advance:
        while run.iteration <= total:
            note(iteration=f"iteration {run.iteration} of {total}", resume=resume_hint(run.checkpoint))
            run.stop_if_prefect_died()  # at a stage boundary
            try:
                with for_iteration(run.iteration):  # the task runs' names: gen[it=12], ...
                    metrics = iteration(run)
            except Exception as exc:
                rebuilds = recover(run, exc, rebuilds + 1)
                continue
            run.history.append({"step": run.iteration, **metrics})
            if warning := zero_reward_warning(run.history, scorer_names(run.scorers)):
                logger().warning(warning)  # the terminal and the flow run's Logs tab
            advance(info=f"reward {metrics['critic/score/mean']:.3f}")
            line = iteration_line(run.iteration, total, metrics)
            logger().info(line)  # the flow run's Logs tab in the Prefect UI
            if run.cfg.trainer.progress:
                console.print(line)
            run.iteration += 1
    return finalize(run.workers, run.tracker, run.cfg, run.resume, run.history, time.perf_counter() - started)


@flow(name="rl-train")
@one_line_errors
def train_flow(
    config: str = "configs/arith_grpo.yaml",
    overrides: list[str] | None = None,
    pipeline: str = "",
    pipeline_version: str = "",
    startup: dict[str, float] | None = None,
) -> dict:
    """RL training (GRPO by default, or another preset) on Ray workers, tracked in MLflow.

    Args:
        config: the YAML config file (configs/*.yaml), relative to the project.
        overrides: config overrides as key=value, e.g. ["algorithm.kl_loss_coef=0.04"].
        pipeline: the pipeline's name (pipelines.yaml), recorded on the MLflow run.
        pipeline_version: the pipeline's version, recorded on the MLflow run.
        startup: set by `reinforge train`: its process's start and the end of its imports (time.time()), so
            the run logs its start-up phases (timing_s/startup/*).
    """
    started, entered = time.perf_counter(), time.time()
    yield_prefect_server()
    cfg = load_checked(config, overrides or [])
    plan = make_plan(cfg)
    starting = StartingWorkers(plan)
    try:
        tokenizer = check_inputs(cfg, plan.algorithm.needs_critic)
        rows = load_datasets(cfg, tokenizer)
        run = open_run(cfg, plan, tokenizer, rows, pipeline, pipeline_version)  # its run directory, locked
        run.marks = {**startup, "prefect": entered} if startup else {}
        try:
            with (
                on_stop("mlflow", lambda: run.tracker.end("KILLED")),
                on_stop("workers", run.stop_workers),
            ):
                return train(run, starting, started)
        except BaseException:
            run.tracker.end("KILLED" if stopping() else "FAILED")
            raise
        finally:
            run.stop_workers()
            run.lock.release()
    finally:
        starting.drop()  # workers no run took (bad inputs, nothing to train, another run holds the lock)


def main(argv: list[str] | None = None) -> int:
    imported = time.time()  # this module, and every module it needs, imported
    a = parsers.train().parse_args(argv)
    import psutil

    startup = {"process": psutil.Process().create_time(), "imports": imported}
    return check_config(a.config, a.overrides, a.debug) or run_cli(
        train_flow, a.config, a.overrides, debug=a.debug, as_json=a.json, startup=startup
    )


if __name__ == "__main__":
    sys.exit(main())
