"""The RL training flow: gen -> reward -> [old_log_prob/ref/values] -> adv -> [update_critic] ->
update_actor (and the weight sync) -> testing -> checkpoint.

Every stage is a task (tasks/rl.py, tasks/tracking.py); this flow only orders them. `iteration` is one RL
iteration; `recover` is what happens when a worker dies; `collect` is generation and rewards, repeated by DAPO's
dynamic sampling until data.batch_size groups with differing rewards are kept. The run plan (components/
plan.py) is made once from the config; the flow and the workers read it, never the config.

Asynchronous modes (trainer.async_mode): the gen and reward tasks of the next iterations are submitted as
Prefect futures (`sample_ahead`) before this iteration's update runs, sampling with the weights the engine
holds (from before the update); the update's weights reach the engine once those rollouts are done
(`push_after_ahead`), and a checkpoint holds the rollouts sampled ahead, so a resume trains on exactly them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil
from prefect import flow

from components.algorithms.shaping import KLController
from components.batch import Batch
from components.config import Config, load_config
from components.data.sampler import PromptSampler
from components.env import dvc_experiment
from components.locking import exclusive, training_lock
from components.outputs import TRAIN_OUTPUT, check_output, claim_output
from components.plan import RunPlan, make_plan
from components.progress import console, iteration_line, progress_bar
from components.rewards.registry import scorers_for
from components.rollout.staleness import overlap_seconds, staleness_metrics, within_bound
from components.services import PrefectWatch
from components.shutdown import note, on_stop, stop, stopping
from components.tracking import checkpoints, runs
from components.tracking.mlflow_tracker import Tracker
from components.training.ray_workers import Workers, ensure_ray, rebuild_workers, stop_workers
from flows import parsers
from flows._args import check_config, run_cli, yield_prefect_server
from flows._logs import one_line_errors
from tasks.common import for_iteration, is_transient, logger
from tasks.data import load_datasets
from tasks.rl import (
    check_inputs,
    compute_advantages,
    evaluate_policy,
    generate_rollouts,
    keep_informative,
    prepare_batch,
    score_rewards,
    start_workers,
    sync_weights,
    update_critic,
    update_policy,
)
from tasks.tracking import (
    checkpoint_metrics,
    finalize,
    log_samples,
    plan_resume,
    restore_checkpoint,
    run_fingerprint,
    save_checkpoint,
    start_run,
    trace_episodes,
)

# the interpreter's start (a run's start-up is timed from it), and the instant this module and every module
# it needs were imported
PROCESS_STARTED, IMPORTED = psutil.Process().create_time(), time.time()
_CLI = {"first_run": False}  # main() sets it: the next run is the one this process was started for


@dataclass
class Run:
    """What a training run holds from start to end: the plan, the data, where it writes and logs, its workers
    (replaced when they are rebuilt) and the loop's position."""

    cfg: Config
    plan: RunPlan
    tokenizer: object
    train_rows: list[dict]
    eval_rows: list[dict]
    scorers: dict  # data_source -> scorer, resolved once here
    resume: runs.ResumePlan
    fingerprint: runs.Fingerprint
    tracker: Tracker
    sampler: PromptSampler
    kl_ctrl: KLController | None
    workers: Workers | None = None
    version: int = 0  # the weights version the rollout engines sample with
    iteration: int = 1  # the next iteration to run
    checkpoint: str | None = None  # the last good checkpoint and its state.json
    state: dict = field(default_factory=dict)
    scored: tuple | None = (
        None  # (iteration, batch, reward metrics, sampler state) until the iteration is done
    )
    history: list[dict] = field(default_factory=list)
    # asynchronous modes: the rollouts sampled ahead, in iteration order
    ahead: list[Ahead] = field(default_factory=list)
    # this process's start-up, as wall-clock instants (time.time()) of its phases; logged (as timing_s/startup/*
    # durations) with the first iteration it runs
    marks: dict[str, float] = field(default_factory=dict)
    watch: PrefectWatch | None = None  # whether the Prefect server still answers

    def stop_workers(self) -> None:
        stop_workers(self.workers)


@dataclass
class Ahead:
    """A rollout sampled ahead of the update (trainer.async_mode): its iteration and its gen and reward task
    futures, or (restored from a checkpoint, or taken) its scored batch and reward metrics."""

    iteration: int
    gen: object = None  # PrefectFuture[Batch]
    reward: object = None  # PrefectFuture[(Batch, metrics)]
    scored: tuple | None = None
    submitted: float = 0.0  # time.perf_counter() when its gen task was submitted

    def result(self) -> tuple:
        if self.scored is None:
            self.scored = self.reward.result()
        return self.scored

    def gen_window(self) -> tuple[float, float] | None:
        """When its generation ran (waiting for it to end): None for one restored from a checkpoint."""
        if self.gen is None:
            return None
        return tuple(self.gen.result().meta["gen_window"])

    def window_so_far(self, now: float) -> tuple[float, float] | None:
        """When its generation ran, without waiting: still running, from its submission to `now` (the engine
        samples the rollouts queued on it back to back, so their union is its busy time either way)."""
        if self.gen is None:
            return None
        return self.gen_window() if self.gen.wrapped_future.done() else (self.submitted, now)

    def to_bytes(self) -> bytes:
        batch, metrics = self.result()
        return Batch(batch.tensors, batch.non_tensors, {**batch.meta, "reward_metrics": metrics}).to_bytes()

    @staticmethod
    def from_bytes(iteration: int, data: bytes) -> Ahead:
        batch = Batch.from_bytes(data)
        return Ahead(iteration, scored=(batch, batch.meta.pop("reward_metrics")))


AHEAD_DIR = "ahead"  # a checkpoint's rollouts sampled ahead: ahead/iter_NNNNNN.batch


def sample_ahead(run: Run) -> None:
    """Submit the gen and reward tasks of the iterations from run.iteration to plan.ahead batches past it
    (never past the last), each sampling with the weights the engine holds now (run.version): their futures
    run beside the update. Rows are drawn here, in iteration order, as the synchronous loop draws them."""
    plan = run.plan
    have = {a.iteration for a in run.ahead}
    for it in range(run.iteration, min(run.iteration + plan.ahead, plan.iterations) + 1):
        if it in have:
            continue
        rows = [run.train_rows[i] for i in run.sampler.next_indices()]
        with for_iteration(it):  # their runs are named after the iteration they sample for
            gen = generate_rollouts.submit(run.workers, rows, plan, it, run.version)
            reward = score_rewards.submit(gen, run.tokenizer, plan, run.workers, run.scorers)
        run.ahead.append(Ahead(it, gen, reward, submitted=time.perf_counter()))


def take_ahead(run: Run, timer: Timer) -> tuple:
    """This iteration's rollout from those sampled ahead, its samples older than trainer.max_staleness dropped
    (sampled again now, when none is left); with async/* metrics."""
    # the next iterations' (and this one's, when none was sampled ahead: the first, or after a restore) start
    # now, with the weights before this iteration's update, and sample beside it
    sample_ahead(run)
    mine = next(a for a in run.ahead if a.iteration == run.iteration)
    start = time.perf_counter()
    batch, metrics = mine.result()
    timer.add("wait_rollout", time.perf_counter() - start)
    run.ahead.remove(mine)
    window = mine.gen_window()
    if window is not None:
        timer.add("gen", window[1] - window[0])
        timer.add("gen_compute", batch.meta.get("gen_seconds", 0.0))
    kept, dropped = within_bound(batch, run.version, run.plan.max_staleness)
    if not len(kept):  # all too old: a fresh rollout with the weights the engine holds now
        kept, metrics = collect(run, timer)
    elif run.plan.algorithm.dynamic_sampling:
        kept, metrics = collect(run, timer, first=(kept, metrics))
    return kept, {**metrics, **staleness_metrics(kept, run.version, dropped)}


def push_after_ahead(run: Run, train_span_start: float) -> dict[str, float]:
    """Asynchronous modes: the update's weights into the engine once the rollouts sampling with the previous
    weights are done (the engine runs them first anyway: it waits no longer than the copy), or with partial
    rollouts at once, landing between two decode steps of the rollout in flight; with timing_s/overlap, the
    seconds of this iteration's training the rollouts sampled beside."""
    if run.workers.rollout.mid_rollout:
        now = time.perf_counter()
        windows = [a.window_so_far(now) for a in run.ahead]
    else:
        windows = [a.gen_window() for a in run.ahead]  # waits for them to end
        now = time.perf_counter()
    overlap = overlap_seconds([w for w in windows if w is not None], (train_span_start, now))
    start = time.perf_counter()
    run.version = sync_weights(run.workers)
    return {"timing_s/overlap": overlap, "timing_s/update_weights": time.perf_counter() - start}


def ahead_files(run: Run) -> dict[str, bytes]:
    """The rollouts sampled ahead, for the checkpoint: a resume trains on exactly these (their weights are
    not the checkpoint's, so they could not be sampled again)."""
    return {f"{AHEAD_DIR}/iter_{a.iteration:06d}.batch": a.to_bytes() for a in run.ahead}


def restore_ahead(run: Run) -> None:
    """The checkpoint's rollouts sampled ahead (none in the synchronous loop)."""
    run.ahead = [
        Ahead.from_bytes(int(p.stem.removeprefix("iter_")), p.read_bytes())
        for p in sorted((Path(run.checkpoint) / AHEAD_DIR).glob("iter_*.batch"))
    ]


class Timer:
    """timing_s/<stage> of one iteration (stages that repeat add up)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[f"timing_s/{name}"] = self.seconds.get(f"timing_s/{name}", 0.0) + seconds

    def __call__(self, name: str, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.add(name, time.perf_counter() - start)
        return out


def collect(run: Run, timer: Timer, first: tuple | None = None) -> tuple:
    """gen + reward; with dynamic sampling, more rounds until data.batch_size informative groups are kept
    (after `first`, a scored round sampled ahead, when given)."""
    plan = run.plan

    def one_round(round_: int):
        rows = [run.train_rows[i] for i in run.sampler.next_indices()]
        batch = timer("gen", generate_rollouts, run.workers, rows, plan, run.iteration, run.version, round_)
        timer.add("gen_compute", batch.meta.get("gen_seconds", 0.0))  # the rollout worker's own part
        return timer("reward", score_rewards, batch, run.tokenizer, plan, run.workers, run.scorers)

    batch, metrics = first or one_round(0)
    if not plan.algorithm.dynamic_sampling:
        return batch, metrics
    rounds = [batch]
    kept, groups = keep_informative(rounds, plan.batch_size)
    while groups < plan.batch_size and len(rounds) < plan.max_gen_rounds:
        rounds.append(one_round(len(rounds))[0])
        kept, groups = keep_informative(rounds, plan.batch_size)
    metrics.update(
        {"dynamic_sampling/groups_kept": float(groups), "dynamic_sampling/gen_rounds": float(len(rounds))}
    )
    return kept, metrics


STARTUP_PHASES = (
    "imports",
    "prefect",
    "setup",
    "workers",
)  # between consecutive marks, from the process's start


def startup_metrics(marks: dict[str, float]) -> dict[str, float]:
    """The process's start-up phases in seconds: imports (interpreter and modules; `reinforge` starts Prefect's
    server meanwhile), prefect (the config's checks, the server if not up yet, the flow run), setup (Ray's
    init, then the inputs, the data and the MLflow run while the workers start), workers (what is left of
    their start, and the checkpoint), and first_gen: the process's start to its first rollout."""
    instants = [marks["process"], *(marks[p] for p in STARTUP_PHASES)]
    out = {f"timing_s/startup/{p}": b - a for p, a, b in zip(STARTUP_PHASES, instants, instants[1:])}
    return out | {"timing_s/startup/first_gen": marks["first_gen"] - marks["process"]}


def stop_if_prefect_died(run: Run) -> None:
    """A dead Prefect server stops the run (the checkpoint before it intact), rather than training on blind
    while its calls retry."""
    problem = run.watch.problem() if run.watch is not None else None
    if problem:
        stop(problem, 2)


def iteration(run: Run) -> dict[str, float]:
    """One RL iteration; returns its metrics (logged, and checkpointed when due)."""
    plan, workers, timer, it = run.plan, run.workers, Timer(), run.iteration
    startup = {}
    if "process" in run.marks:  # the first iteration of the run this process started for: its start-up
        startup, run.marks = startup_metrics({**run.marks, "first_gen": time.time()}), {}
    if run.scored is not None and run.scored[0] == it:  # rebuilt mid-iteration: reuse what was scored,
        _, batch, m_reward, sampler_state = run.scored  # so each sample is scored once
        run.sampler.load_state_dict(sampler_state)
    else:
        batch, m_reward = take_ahead(run, timer) if plan.async_mode != "sync" else collect(run, timer)
        run.scored = (it, batch, m_reward, run.sampler.state_dict())
    train_start = time.perf_counter()
    if plan.algorithm.needs_critic or plan.policy.need_old or workers.reference is not None:
        batch, t_prep = prepare_batch(workers, batch)
        timer.seconds.update(t_prep)
    batch, m_adv = timer("adv", compute_advantages, batch, plan, run.kl_ctrl.value if run.kl_ctrl else None)
    if run.kl_ctrl is not None:
        run.kl_ctrl.update(m_adv["actor/reward_kl_penalty"], len(batch))
    m_critic = timer("update_critic", update_critic, workers, batch) if plan.algorithm.needs_critic else {}
    if plan.async_mode == "sync":
        m_actor, run.version = update_policy(workers, batch)  # its own timing_s/update_actor, _weights
    else:
        m_actor, _ = update_policy(workers, batch, push=False)
        m_actor.update(push_after_ahead(run, train_start))
    metrics = {**m_reward, **m_adv, **m_critic, **m_actor}
    if it % plan.test_interval == 0 or it == plan.iterations:
        samples: list[dict] = []
        metrics.update(
            timer(
                "testing", evaluate_policy, workers, run.eval_rows, plan, run.tokenizer, run.scorers, samples
            )
        )
        stop_if_prefect_died(run)  # before the evaluation's artifact, a call the dead server would stall
        log_samples(run.tracker, samples, it, metrics)  # a few held-out prompts, the model's answers
        if plan.rollout.multi_turn is not None:  # and a few of this iteration's episodes, turn by turn
            trace_episodes(run.tracker, batch, run.tokenizer, it)
    metrics["timing_s/step"] = time.perf_counter() - timer.start
    metrics.update(timer.seconds)
    metrics.update(startup)
    # queued (MLflow stores them in the background; the checkpoint waits for them), before the checkpoint: a
    # crash between the two re-runs `it`
    run.tracker.log_metrics(metrics, it)
    if it % plan.save_interval == 0 or it == plan.iterations:  # `it`, whose metrics are not re-logged
        run.checkpoint, run.state = save_checkpoint(
            workers,
            run.tracker,
            run.cfg,
            run.resume,
            it,
            {
                "sampler": run.sampler.state_dict(),
                "weights_version": run.version,
                **run.fingerprint.state(),
                **({"kl_ctrl": run.kl_ctrl.state_dict()} if run.kl_ctrl is not None else {}),
            },
            ahead_files(run),
        )
        run.tracker.log_metrics(checkpoint_metrics(run.state), it)
        metrics.update(checkpoint_metrics(run.state))
    return metrics


def restore(run: Run) -> None:
    """Fresh workers into the last checkpoint's state (or the start when there is none): the policy worker's
    weights, optimizer and RNG, then the engine, the sampler and the controller."""
    run.sampler.load_state_dict(
        run.state.get("sampler", {**run.sampler.state_dict(), "epoch": 0, "cursor": 0})
    )
    if run.kl_ctrl is not None:
        run.kl_ctrl.load_state_dict(run.state.get("kl_ctrl", {"value": run.kl_ctrl.start}))
    run.ahead = []  # sampled by workers that are gone, or by none yet: a checkpoint's are restored below
    if run.checkpoint is None:
        run.version, run.iteration = 0, 1
        return
    restore_checkpoint(run.workers, run.checkpoint)
    restore_ahead(run)
    if run.state.get("mlflow_run_id") == run.tracker.run_id:  # its own run: if killed before this was logged
        run.tracker.log_metrics(checkpoint_metrics(run.state), run.state["iteration"])
    run.version, run.iteration = sync_weights(run.workers), run.state["iteration"] + 1


def recover(run: Run, exc: Exception, rebuilds: int) -> None:
    """A worker died for good (a policy actor is never restarted by Ray, a hung call was killed): new workers
    from this run's last checkpoint (or its start), then on from there; steps already logged stay once. Any
    other error, or more than trainer.max_worker_rebuilds, ends the run."""
    if not is_transient(exc) or rebuilds > run.plan.max_worker_rebuilds:
        raise exc
    logger().warning(
        "iteration %d: a worker died (%s); rebuilding from the last checkpoint (%d/%d)",
        run.iteration,
        type(exc).__name__,
        rebuilds,
        run.plan.max_worker_rebuilds,
    )
    run.workers = rebuild_workers(run.workers, run.plan)
    if run.plan.async_mode != "sync":  # the checkpoint's rollouts sampled ahead replace those in flight, and
        run.scored = None  # the iteration's own is among them (or sampled again): the sampler stays in step
    if run.checkpoint is not None:
        checkpoints.verify(Path(run.checkpoint))
    restore(run)


def _resume_hint(ckpt: str | None) -> str:
    return (
        f"The last checkpoint is {ckpt}: run the same command to resume from it."
        if ckpt
        else "No checkpoint was saved yet: run the same command to start again."
    )


@dataclass
class StartingWorkers:
    """The workers' start (the start-workers task), submitted as the flow begins: the actors' processes import
    torch and load the model while this process checks the inputs, loads the data and opens the MLflow run
    (~2 s of a ~6 s start on 2 cores). The run takes them; drop() stops them when none does."""

    future: object  # PrefectFuture[Workers]
    taken: bool = False

    @classmethod
    def submit(cls, plan: RunPlan) -> StartingWorkers:
        ensure_ray()  # here: Ray's init must run in the main thread; the actors start in the task's thread
        return cls(start_workers.submit(plan))

    def take(self) -> Workers:
        self.taken = True
        return self.future.result()

    def drop(self) -> None:
        if not self.taken:
            self.taken = True
            with contextlib.suppress(
                Exception
            ):  # a start that failed: the error that ended the run is reported
                stop_workers(self.future.result())


def train(run: Run, starting: StartingWorkers, started: float) -> dict:
    """Take the started workers, restore, run the iterations (recovering from dead workers), save the final
    model."""
    t, rebuilds = run.plan, 0
    from prefect.runtime import flow_run

    run.watch = PrefectWatch(flow_run_id=flow_run.id)
    run.marks["setup"] = time.time()
    run.workers = starting.take()
    restore(run)
    run.marks["workers"] = time.time()
    with progress_bar(
        run.cfg.algorithm.name, t.iterations - run.iteration + 1, run.cfg.trainer.progress
    ) as advance:
        while run.iteration <= t.iterations:
            note(
                iteration=f"iteration {run.iteration} of {t.iterations}", resume=_resume_hint(run.checkpoint)
            )
            stop_if_prefect_died(run)  # at a stage boundary
            try:
                with for_iteration(run.iteration):  # the task runs' names: gen[it=12], ...
                    metrics = iteration(run)
            except Exception as exc:
                rebuilds += 1
                recover(run, exc, rebuilds)
                continue
            run.history.append({"step": run.iteration, **metrics})
            advance(info=f"reward {metrics['critic/score/mean']:.3f}")
            line = iteration_line(run.iteration, t.iterations, metrics)
            logger().info(line)  # the flow run's Logs tab in the Prefect UI
            if run.cfg.trainer.progress:
                console.print(line)
            run.iteration += 1
    return finalize(run.workers, run.tracker, run.cfg, run.resume, run.history, time.perf_counter() - started)


def open_run(
    cfg: Config, plan: RunPlan, tokenizer, train_rows, eval_rows, pipeline: str, version: str
) -> Run:
    """What this training continues (refusing, before anything is written, when there is nothing to train),
    its output directory and its MLflow run."""
    t = cfg.trainer
    fingerprint = run_fingerprint(cfg)  # config, data, models, reward: what a checkpoint must match to resume
    resume = plan_resume(cfg, fingerprint)
    claim_output(t.output_dir, "trainer.output_dir", TRAIN_OUTPUT, t.run_dir)
    # what ran: the pipeline (or the DVC experiment), the preset and the run's fingerprint (its run
    # directory's name), then when
    label = pipeline or dvc_experiment().get("name") or "train"
    run_name = f"{label}-{cfg.algorithm.name}-{fingerprint.digest[:10]}-{datetime.now(UTC):%m%d-%H%M}"
    tracker = start_run(cfg, pipeline, version, run_name, resume, fingerprint, plan.params)
    scorers = scorers_for([r["data_source"] for r in train_rows + eval_rows], cfg)
    kl_ctrl = KLController(*plan.kl_in_reward) if plan.kl_in_reward else None
    return Run(
        cfg,
        plan,
        tokenizer,
        train_rows,
        eval_rows,
        scorers,
        resume,
        fingerprint,
        tracker,
        PromptSampler(len(train_rows), plan.batch_size, plan.shuffle, plan.seed),
        kl_ctrl,
        checkpoint=str(resume.checkpoint) if resume.checkpoint else None,
        state=resume.state,
    )


@flow(name="rl-train")
@one_line_errors
def train_flow(
    config: str = "configs/arith_grpo.yaml",
    overrides: list[str] | None = None,
    pipeline: str = "",
    pipeline_version: str = "",
) -> dict:
    """RL training (GRPO by default, or another preset) on Ray workers, tracked in MLflow.

    Args:
        config: the YAML config file (configs/*.yaml), relative to the project.
        overrides: config overrides as key=value, e.g. ["algorithm.kl_loss_coef=0.04"].
        pipeline: the pipeline's name (pipelines.yaml), recorded on the MLflow run.
        pipeline_version: the pipeline's version, recorded on the MLflow run.
    """
    started, entered = time.perf_counter(), time.time()
    yield_prefect_server()
    cfg = load_config(config, overrides or [])
    plan = make_plan(cfg)
    starting = StartingWorkers.submit(plan)
    try:
        tokenizer = check_inputs(cfg, plan.algorithm.needs_critic)
        train_rows, eval_rows = load_datasets(cfg, tokenizer)
        output = check_output(cfg.trainer.output_dir, "trainer.output_dir", TRAIN_OUTPUT, cfg.trainer.run_dir)
        with exclusive(training_lock(output), f"a training run in {output}"):
            run = open_run(cfg, plan, tokenizer, train_rows, eval_rows, pipeline, pipeline_version)
            if _CLI[
                "first_run"
            ]:  # the run this process started for (`reinforge train`): its start-up is timed
                _CLI["first_run"] = False
                run.marks = {"process": PROCESS_STARTED, "imports": IMPORTED, "prefect": entered}
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
    finally:
        starting.drop()  # workers no run took (bad inputs, nothing to train, another run holds the lock)


def main(argv: list[str] | None = None) -> int:
    a = parsers.train().parse_args(argv)
    _CLI["first_run"] = True
    return check_config(a.config, a.overrides, a.debug) or run_cli(
        train_flow, a.config, a.overrides, debug=a.debug, as_json=a.json
    )


if __name__ == "__main__":
    sys.exit(main())
