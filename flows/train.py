"""The RL training flow: gen -> reward -> [old_log_prob/ref/values] -> adv -> [update_critic] ->
update_actor (and the weight sync) -> testing -> checkpoint.

Every stage is a task; this flow only orders them, times them and decides when to test and save. With
DAPO's dynamic sampling, gen and reward repeat (up to algorithm.max_num_gen_batches rounds) until the batch
holds data.batch_size groups whose rewards differ.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from prefect import flow

from components.algorithms.presets import resolve
from components.algorithms.shaping import KLController, group_counts
from components.config import load_config
from components.locking import exclusive
from components.outputs import TRAIN_OUTPUT, check_output, claim_output
from components.services import PrefectWatch
from components.shutdown import note, on_stop, stop, stopping
from components.data.sampler import PromptSampler
from components.tracking import checkpoints
from components.rl import concat_rounds, first_groups, informative_rows
from components.progress import console, iteration_line, progress_bar
from components.training.ray_workers import rebuild_workers, stop_workers
from flows._args import check_config, config_parser, run_cli, yield_prefect_server
from tasks.data import load_datasets
from tasks.common import is_transient, logger
from tasks.rl import check_inputs, compute_advantages, evaluate_policy, generate_rollouts, prepare_batch, \
    score_rewards, start_workers, sync_weights, update_critic, update_policy
from tasks.tracking import checkpoint_metrics, finalize, log_metrics, plan_training, restore_checkpoint, \
    run_fingerprint, save_checkpoint, start_run


def _add_time(timings: dict, name: str, seconds: float) -> None:
    """Add seconds to timing_s/{name} (stages that repeat add up)."""
    key = f"timing_s/{name}"
    timings[key] = timings.get(key, 0.0) + seconds


def _timed(timings: dict, name: str, fn, *args):
    """Run fn(*args), adding its seconds to timing_s/{name}."""
    start = time.perf_counter()
    out = fn(*args)
    _add_time(timings, name, time.perf_counter() - start)
    return out


def _collect_batch(timings, workers, sampler, train_rows, tokenizer, cfg, it, version):
    """gen + reward; with dynamic sampling, more rounds until data.batch_size informative groups are kept."""
    def one_round(round_: int):
        rows = [train_rows[i] for i in sampler.next_indices()]
        batch = _timed(timings, "gen", generate_rollouts, workers, rows, cfg, it, version, round_)
        _add_time(timings, "gen_compute", batch.meta.get("gen_seconds", 0.0))  # the rollout worker's own part
        return _timed(timings, "reward", score_rewards, batch, tokenizer, cfg, workers)

    batch, metrics = one_round(0)
    if not resolve(cfg.algorithm).dynamic_sampling:
        return batch, metrics
    kept, rounds = [informative_rows(batch)], 1
    groups = group_counts(kept[0].tensors["group_ids"])  # rounds never share a group: their counts add up
    while groups < cfg.data.batch_size and rounds < cfg.algorithm.max_num_gen_batches:
        kept.append(informative_rows(one_round(rounds)[0]))
        groups += group_counts(kept[-1].tensors["group_ids"])
        rounds += 1
    filtered = first_groups(concat_rounds(kept), cfg.data.batch_size)
    groups = group_counts(filtered.tensors["group_ids"])
    metrics.update({"dynamic_sampling/groups_kept": float(groups), "dynamic_sampling/gen_rounds": float(rounds)})
    # no informative group at all: keep the first round, whose advantages are all zero (a no-op policy step)
    return (filtered if groups else batch), metrics


def _restore(workers, ckpt: str | None, state: dict, sampler: PromptSampler, kl_ctrl: KLController | None,
             tracker) -> tuple[int, int]:
    """Fresh workers into the checkpoint's state (or the start when there is none): the policy worker's
    weights, optimizer and RNG, then the engine, the sampler and the controller. Returns (version, first
    iteration to run)."""
    sampler.load_state_dict(state.get("sampler", {**sampler.state_dict(), "epoch": 0, "cursor": 0}))
    if kl_ctrl is not None:
        kl_ctrl.load_state_dict(state.get("kl_ctrl", {"value": kl_ctrl.start}))
    if ckpt is None:
        return 0, 1
    restore_checkpoint(workers, ckpt)
    if state.get("mlflow_run_id") == tracker.run_id:  # its own run: if killed before this was logged
        log_metrics(tracker, checkpoint_metrics(state), state["iteration"])
    return sync_weights(workers), state["iteration"] + 1


@flow(name="rl-train")
def train_flow(config: str = "configs/arith_grpo.yaml", overrides: list[str] | None = None, pipeline: str = "",
               pipeline_version: str = "") -> dict:
    started = time.perf_counter()
    yield_prefect_server()
    cfg = load_config(config, overrides or [])
    t = cfg.trainer
    tokenizer = check_inputs(cfg)
    train_rows, eval_rows = load_datasets(cfg, tokenizer)
    output = check_output(t.output_dir, "trainer.output_dir", TRAIN_OUTPUT, t.run_dir)  # ours to write?
    with exclusive(output.parent / f".{output.name}.lock", f"a training run in {output}"):
        return _train(cfg, pipeline, pipeline_version, tokenizer, train_rows, eval_rows, started)


def _train(cfg, pipeline: str, pipeline_version: str, tokenizer, train_rows: list[dict], eval_rows: list[dict],
           started: float) -> dict:
    t = cfg.trainer
    run_name = f"{pipeline or 'train'}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    fingerprint = run_fingerprint(cfg)  # config, data, models, reward: what a checkpoint must match to resume
    plan = plan_training(cfg, fingerprint)  # may refuse (nothing to train): nothing is written before this
    claim_output(t.output_dir, "trainer.output_dir", TRAIN_OUTPUT, t.run_dir)
    ckpt, state = (str(plan.checkpoint) if plan.checkpoint else None), plan.state
    tracker = start_run(cfg, pipeline, pipeline_version, run_name, plan, fingerprint)
    sampler = PromptSampler(len(train_rows), cfg.data.batch_size, cfg.data.shuffle, t.seed)
    a = cfg.algorithm
    kl_ctrl = KLController(a.kl_coef, a.kl_ctrl, a.kl_target, a.kl_horizon) if a.use_kl_in_reward else None
    history: list[dict] = []
    group = _Group()
    prefect = PrefectWatch()
    try:
        with on_stop("mlflow", lambda: tracker.end("KILLED")), on_stop("workers", group.stop):
            group.workers = start_workers(cfg)
            version, it = _restore(group.workers, ckpt, state, sampler, kl_ctrl, tracker)
            return _loop(cfg, plan, tracker, group, sampler, kl_ctrl, train_rows, eval_rows, tokenizer, fingerprint,
                         version, it, ckpt, state, history, started, prefect)
    except BaseException:
        tracker.end("KILLED" if stopping() else "FAILED")
        raise
    finally:
        group.stop()


class _Group:
    """The run's worker group, replaced when it is rebuilt; stop() stops whichever is current."""

    workers = None

    def stop(self) -> None:
        if self.workers is not None:
            stop_workers(self.workers)


def _resume_hint(ckpt: str | None) -> str:
    return (f"The last checkpoint is {ckpt}: run the same command to resume from it." if ckpt else
            "No checkpoint was saved yet: run the same command to start again.")


def _loop(cfg, plan, tracker, group: "_Group", sampler, kl_ctrl, train_rows, eval_rows, tokenizer, fingerprint,
          version, it, ckpt, state, history, started, prefect) -> dict:
    t, algo, rebuilds = cfg.trainer, resolve(cfg.algorithm), 0
    workers = group.workers
    scored = None  # (iteration, batch, reward metrics, sampler state): kept until the iteration is done
    with progress_bar("grpo", t.iterations - it + 1, t.progress) as advance:
        while it <= t.iterations:
            note(iteration=f"iteration {it} of {t.iterations}", resume=_resume_hint(ckpt))
            problem = prefect.problem()  # at a stage boundary: a dead server stops the run here
            if problem:
                stop(problem, 2)
            timings: dict[str, float] = {}
            step_start = time.perf_counter()
            try:
                if scored is not None and scored[0] == it:  # rebuilt mid-iteration: reuse what was scored,
                    _, batch, m_reward, sampler_state = scored  # so each sample is scored once
                    sampler.load_state_dict(sampler_state)
                else:
                    batch, m_reward = _collect_batch(timings, workers, sampler, train_rows, tokenizer, cfg, it,
                                                     version)
                    scored = (it, batch, m_reward, sampler.state_dict())
                if algo.needs_critic or kl_ctrl is not None or workers.reference is not None:
                    batch, t_prep = prepare_batch(workers, batch)
                    timings.update(t_prep)
                batch, m_adv = _timed(timings, "adv", compute_advantages, batch, cfg,
                                      kl_ctrl.value if kl_ctrl else None)
                if kl_ctrl is not None:
                    kl_ctrl.update(m_adv["actor/reward_kl_penalty"], len(batch))
                m_critic = _timed(timings, "update_critic", update_critic, workers, batch) \
                    if algo.needs_critic else {}
                m_actor, version = update_policy(workers, batch)  # its own timing_s/update_actor, _weights
                metrics = {**m_reward, **m_adv, **m_critic, **m_actor}
                if it % t.test_interval == 0 or it == t.iterations:
                    metrics.update(_timed(timings, "testing", evaluate_policy, workers, eval_rows, cfg))
                timings["timing_s/step"] = time.perf_counter() - step_start
                metrics.update(timings)
                log_metrics(tracker, metrics, it)  # before the checkpoint: a crash between the two re-runs
                if it % t.save_interval == 0 or it == t.iterations:  # `it`, whose metrics are not re-logged
                    ckpt, state = save_checkpoint(workers, tracker, cfg, plan, it, {
                        "sampler": sampler.state_dict(), "weights_version": version, **fingerprint.state(),
                        **({"kl_ctrl": kl_ctrl.state_dict()} if kl_ctrl is not None else {})})
                    log_metrics(tracker, checkpoint_metrics(state), it)
                    metrics.update(checkpoint_metrics(state))
            except Exception as exc:
                if not is_transient(exc) or rebuilds >= t.max_worker_rebuilds:
                    raise
                # a worker died for good (the policy actor is never restarted by Ray): new workers from this
                # run's last checkpoint (or its start), then on from there; steps already logged stay once
                rebuilds += 1
                logger().warning("iteration %d: a worker died (%s); rebuilding from the last checkpoint "
                                 "(%d/%d)", it, type(exc).__name__, rebuilds, t.max_worker_rebuilds)
                workers = group.workers = rebuild_workers(workers, cfg)
                if ckpt is not None:
                    checkpoints.verify(Path(ckpt))
                version, it = _restore(workers, ckpt, state, sampler, kl_ctrl, tracker)
                continue
            history.append({"step": it, **metrics})
            advance(info=f"reward {metrics['critic/score/mean']:.3f}")
            if t.progress:
                console.print(iteration_line(it, t.iterations, metrics))
            it += 1
    return finalize(workers, tracker, cfg, plan, history, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    a = config_parser("Run GRPO (or another preset) on the SFT model; metrics and checkpoints go to MLflow.",
                      "reinforge train").parse_args(argv)
    return check_config(a.config, a.overrides, a.debug) or run_cli(train_flow, a.config, a.overrides, debug=a.debug)


if __name__ == "__main__":
    sys.exit(main())
