"""One RL iteration's stages as Prefect tasks over the run plan. Heavy work runs on the Ray actors behind the
typed handles of `Workers` (components/training/ray_workers.py)."""

from __future__ import annotations

import contextlib
import time

from components.algorithms.shaping import group_counts
from components.batch import Batch
from components.config import Config
from components.envs.agent import check_agent
from components.errors import ConfigError
from components.evaluation import evaluate
from components.models.loading import check_model_dir, load_image_encoder, load_tokenizer
from components.plan import RunPlan
from components.rewards.custom import check_custom_reward
from components.rl import (
    Score,
    add_advantages,
    first_groups,
    informative_rows,
    place_rewards,
    rollout_metrics,
    score_baseline,
    score_responses,
)
from components.rollout.batching import concat_rounds, decode_responses
from components.seeding import derive_seed
from components.services import check_run_services
from components.training import backends, ray_workers
from components.training.ray_workers import Workers
from tasks.common import is_transient, logger, stage


@stage(name="check-inputs")
def check_inputs(cfg: Config, needs_critic: bool):
    """What can be checked before any worker or MLflow run starts: the custom reward function, the services,
    the policy's tokenizer (loaded as saved, checked) and weights, the critic's and reward model's directories.
    Returns the tokenizer."""
    check_custom_reward(cfg)
    check_agent(cfg)
    check_run_services(cfg)  # a deployment's run, which no CLI checked
    trust = cfg.actor.model.trust_remote_code
    tokenizer = load_tokenizer(cfg.actor.model.path, trust_remote_code=trust)
    check_model_dir(cfg.actor.model.path, "actor.model.path", trust_remote_code=trust)
    check_vision(cfg, tokenizer)
    if cfg.critic.model_path and needs_critic:
        check_model_dir(cfg.critic.model_path, "critic.model_path", trust_remote_code=trust)
    if cfg.reward_model.path:
        check_model_dir(cfg.reward_model.path, "reward_model.path", trust_remote_code=trust)
    if cfg.multi_turn.enable and not tokenizer.chat_template:
        raise ConfigError(
            f"multi_turn.enable=true: the tokenizer of actor.model.path={cfg.actor.model.path} has "
            "no chat template, which tool turns are rendered with. Use a model whose tokenizer has "
            "one, or set multi_turn.enable=false."
        )
    return tokenizer


def check_vision(cfg: Config, tokenizer) -> None:
    """The policy directory and actor.model.type agree, and a VLM's image takes at most
    actor.model.vision_token_ratio of max_seq_len; ConfigError naming the key and the fix otherwise."""
    m = cfg.actor.model
    images = load_image_encoder(m.path, tokenizer, trust_remote_code=m.trust_remote_code)
    if (images is not None) != (m.type == "multimodal"):
        what = "a vision-language model" if images is not None else "a text-only model"
        want = "multimodal" if images is not None else "text"
        raise ConfigError(
            f"actor.model.type={m.type}, but actor.model.path={m.path} is {what}; set actor.model.type={want}."
        )
    if images is not None and images.image_tokens > m.vision_token_ratio * m.max_seq_len:
        raise ConfigError(
            f"actor.model.vision_token_ratio={m.vision_token_ratio}: an image of actor.model.path={m.path} takes "
            f"{images.image_tokens} tokens, more than {m.vision_token_ratio} x actor.model.max_seq_len="
            f"{m.max_seq_len}. Raise the ratio or max_seq_len, or use a model whose processor makes fewer "
            "image tokens (a composed model pools its patches to fit)."
        )


@stage(name="start-workers")
def start_workers(plan: RunPlan, started: ray_workers.Started | None = None) -> Workers:
    """Start the policy and rollout actors (kept for the whole run), where trainer.backend puts them."""
    return backends.start_workers(plan, started)


class StartingWorkers:
    """The workers' start (the start-workers task), submitted as the flow begins when they are actors: their
    processes import torch and load the model while the driver checks the inputs, loads the data and opens the
    MLflow run (~2 s of a ~6 s start on 2 cores). Workers in this process (trainer.backend=local) start when
    taken, once the inputs are good: a thread beside the checks would hold the interpreter's lock through its
    imports, and a bad input would wait for them (~3.5 s). The run takes them; drop() stops them when none
    does."""

    def __init__(self, plan: RunPlan):
        # here: Ray's init must run in the main thread; the actors start in the task's
        self.plan, self.started, self.taken = plan, backends.starting(plan), False
        self.future = start_workers.submit(plan, self.started) if backends.starts_ahead(plan) else None

    def take(self) -> Workers:
        self.taken = True
        if self.future is None:
            return start_workers(self.plan, self.started)
        return self.future.result()

    def drop(self) -> None:
        """No run takes the workers: the actors made so far are killed at once, and the start, which then
        fails at its next wait, is waited for (a second or less) so that nothing outlives the run."""
        if not self.taken:
            self.taken = True
            self.started.abandon()
            if self.future is None:  # never started
                return
            # a start that failed or was abandoned: the error that ended the run is the one reported
            with contextlib.suppress(Exception):
                self.future.result().stop()


def _engine_seeds(workers: Workers, seed: int) -> list[int]:
    engines = len(workers.rollout.engines())
    return [seed] if engines == 1 else [derive_seed(seed, "engine", k) for k in range(engines)]


@stage(name="gen")
def generate_rollouts(
    workers: Workers, rows: list[dict], plan: RunPlan, iteration: int, version: int, round_: int = 0
) -> Batch:
    """engine.n completions per prompt, sampled with weights `version` (checked by the engine); remax also
    gets one greedy completion per prompt. `round_` counts dynamic sampling's extra rounds. A dead engine is
    the rollout group's to restart (and its share retried), not this task's."""
    seed = derive_seed(plan.seed, iteration, "rollout", *([round_] if round_ else []))
    start = time.perf_counter()
    batch = workers.sample(
        rows,
        plan.sampling,
        seed,
        iteration,
        version,
        plan.algorithm.needs_baseline,
        _engine_seeds(workers, seed),
    )
    batch.meta["gen_window"] = (start, time.perf_counter())  # when it ran: its overlap with the update
    return batch


def scorer(workers: Workers, scorers: dict) -> Score:
    """The one scoring path, for training rewards and held-out evaluation: the reward group's actor, bounded
    by trainer.stage_timeout_s. (texts, truths, sources, extras) -> (scores, valid, sub-scores)."""
    return lambda texts, truths, sources, extras: workers.rewards.score(
        texts, truths, sources, extras, scorers
    )


@stage(name="reward")
def score_rewards(
    batch: Batch, tokenizer, plan: RunPlan, workers: Workers, scorers: dict
) -> tuple[Batch, dict[str, float]]:
    """Decode the responses, score them (each row by its data_source's scorer; with reward_model.path, mixed
    with the reward model's scores), and place the rewards on their tokens (with DAPO's overlong penalty,
    and remax's greedy baseline scored too)."""
    score = scorer(workers, scorers)
    texts = decode_responses(tokenizer, batch)
    model_scores = None
    if workers.reward_model is not None:
        prompts = decode_responses(tokenizer, batch, "prompts", "prompt_mask", skip_special_tokens=False)
        model_scores = workers.reward_model.score(prompts, texts)
    scored = score_responses(batch, texts, score, plan.rewards, model_scores)
    baseline = None
    if "baseline_responses" in batch.tensors:
        greedy = decode_responses(tokenizer, batch, "baseline_responses", "baseline_mask")
        baseline = score_baseline(batch, greedy, score)
    batch, placed = place_rewards(batch, scored, plan.rewards, baseline)
    return batch, {**scored.metrics, **placed, **rollout_metrics(batch)}


@stage(name="dynamic-sampling")
def keep_informative(rounds: list[Batch], n_groups: int) -> tuple[Batch, int]:
    """DAPO's dynamic sampling: the first `n_groups` groups whose rewards differ, over all generation rounds
    so far (rounds never share a group), and how many there are. With none at all, the first round: its
    advantages are all zero, a no-op policy step."""
    kept = first_groups(concat_rounds([informative_rows(b) for b in rounds]), n_groups)
    groups = group_counts(kept.tensors["group_ids"])
    return (kept if groups else rounds[0]), groups


@stage(name="old-log-prob")
def prepare_batch(workers: Workers, batch: Batch) -> tuple[Batch, dict[str, float]]:
    """Old and reference log-probs and critic values, when the advantages or the update need them; with
    per-stage seconds. A separate reference actor (trainer.ref_placement=separate) computes its log-probs, a
    separate distillation teacher (distill.placement=separate) its."""
    own = {}
    for key, group, timing in (
        ("ref_logprobs", workers.reference, "timing_s/ref"),
        ("teacher_logprobs", workers.teacher, "timing_s/teacher"),
    ):
        if group is not None:
            start = time.perf_counter()
            batch = batch.union(**{key: group.logprobs(batch)})
            own[timing] = time.perf_counter() - start
    batch, timings = workers.policy.prepare(batch)
    return batch, {**timings, **own}


@stage(name="adv")
def compute_advantages(
    batch: Batch, plan: RunPlan, kl_coef: float | None = None
) -> tuple[Batch, dict[str, float]]:
    """Advantages by the preset's estimator; kl_coef subtracts the KL to the reference from the rewards; a
    teacher (plan.distill) makes them on-policy distillation's."""
    return add_advantages(batch, plan.algorithm, kl_coef, plan.rewards.kl_penalty, plan.distill)


@stage(name="update-critic")
def update_critic(workers: Workers, batch: Batch) -> dict[str, float]:
    return workers.policy.update_critic(batch)


@stage(name="update-actor")
def update_policy(workers: Workers, batch: Batch, push: bool = True) -> tuple[dict[str, float], int]:
    """One policy update on the workers, then (`push`) its weights into the rollout engine; returns the
    update's metrics (timing_s/update_actor and timing_s/update_weights among them) and the weights version
    the engine holds. Asynchronous modes push later (sync_weights), once the rollouts sampling with the
    previous weights are done.

    One task, not two: each task run costs the Prefect server ~20 ms of CPU. The update is never retried (it
    would step twice); a push that fails because the rollout actor died is not an error of the update: Ray
    restarts that actor and `ensure_current` gives it these weights before it samples again."""
    start = time.perf_counter()
    metrics = workers.policy.update(batch)
    synced = time.perf_counter()
    if not push:
        return {**metrics, "timing_s/update_actor": synced - start}, -1
    try:
        version = workers.push_weights()
    except Exception as exc:
        if not is_transient(exc):
            raise
        logger().warning(
            "weights not pushed to the rollout engine (%s); it gets them before it samples",
            type(exc).__name__,
        )
        version = workers.policy.state()["version"]
    done = time.perf_counter()
    return {
        **metrics,
        "timing_s/update_actor": synced - start,
        "timing_s/update_weights": done - synced,
    }, version


@stage(name="update-weights")
def sync_weights(workers: Workers) -> int:
    """Push the policy's weights to the rollout engine; returns their version (after a restore; each
    iteration's update pushes its own)."""
    return workers.push_weights()


@stage(name="testing")
def evaluate_policy(
    workers: Workers,
    rows: list[dict],
    plan: RunPlan,
    tokenizer,
    scorers: dict,
    samples: list[dict] | None = None,
) -> dict[str, float]:
    """Greedy accuracy and mean@k / pass@k on the held-out rows with the current weights: sampled by the
    rollout group, decoded here, scored on the training rewards' path (the RewardScorer actor). `samples`
    receives the first SAMPLES rows with images, with their greedy answers and scores (logged to MLflow)."""
    e = plan.evaluation
    rows = rows[: e.size] if e.size else rows
    version = workers.policy.state()["version"]
    workers.ensure_current(version)

    def generate(chunk, params, seed):
        return workers.rollout.generate(chunk, params, seed, -1, version, seeds=_engine_seeds(workers, seed))

    return evaluate(
        generate,
        lambda batch: decode_responses(tokenizer, batch),
        scorer(workers, scorers),
        rows,
        e.k,
        e.max_new_tokens,
        derive_seed(e.seed, "eval"),
        e.temperature,
        on_greedy=None if samples is None else lambda chunk, texts, s: keep_samples(samples, chunk, texts, s),
    )


SAMPLES = 8  # held-out prompts logged with the model's greedy answers at each evaluation


def keep_samples(samples: list[dict], rows: list[dict], texts: list[str], scores: list[float]) -> None:
    for row, text, score in zip(rows, texts, scores):
        if len(samples) < SAMPLES:
            samples.append({"row": row, "answer": text, "score": score})
