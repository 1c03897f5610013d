"""One RL iteration's stages as Prefect tasks. Heavy work runs on the Ray actors in `Workers`."""

from __future__ import annotations

import time

from components.algorithms.presets import resolve
from components.batch import Batch
from components.config import Config
from components.data.prompts import prompt_text
from components.errors import ConfigError
from components.models.loading import check_model_dir, load_tokenizer
from components.rewards.custom import check_custom_reward
from components.services import check_services
from components.rewards.registry import scorers_for
from components.rl import add_advantages, add_rewards, decode_responses
from components.rollout.base import SamplingParams
from components.training import ray_workers
from components.training.ray_workers import Workers
from components.training.seeding import derive_seed
from tasks.common import RETRY_TRANSIENT, is_transient, logger, retry_transient, stage


def sampling_params(cfg: Config) -> SamplingParams:
    e = cfg.engine
    return SamplingParams(n=e.n, temperature=e.temperature, top_p=e.top_p, top_k=e.top_k,
                          max_new_tokens=e.max_new_tokens)


@stage(name="check-inputs")
def check_inputs(cfg: Config):
    """What can be checked before any worker or MLflow run starts: the policy's tokenizer (loaded as saved,
    checked) and weights, the critic's and reward model's directories. Returns the tokenizer."""
    check_custom_reward(cfg)
    check_services(cfg.trainer.connect_timeout_s)  # a deployment's run, which no CLI checked
    tokenizer = load_tokenizer(cfg.actor.model.path)
    check_model_dir(cfg.actor.model.path, "actor.model.path")
    if cfg.critic.model_path and resolve(cfg.algorithm).needs_critic:
        check_model_dir(cfg.critic.model_path, "critic.model_path")
    if cfg.reward_model.path:
        check_model_dir(cfg.reward_model.path, "reward_model.path")
    if cfg.multi_turn.enable and not tokenizer.chat_template:
        raise ConfigError(f"multi_turn.enable=true: the tokenizer of actor.model.path={cfg.actor.model.path} has "
                          "no chat template, which tool turns are rendered with. Use a model whose tokenizer has "
                          "one, or set multi_turn.enable=false.")
    return tokenizer


@stage(name="start-workers")
def start_workers(cfg: Config) -> Workers:
    """Start the policy and rollout actors (kept for the whole run)."""
    return ray_workers.start_workers(cfg)


@stage(name="gen", retry_condition_fn=retry_transient, **RETRY_TRANSIENT)
def generate_rollouts(workers: Workers, rows: list[dict], cfg: Config, iteration: int, version: int,
                      round_: int = 0) -> Batch:
    """engine.n completions per prompt, sampled with weights `version` (checked by the engine); remax also
    gets one greedy completion per prompt. `round_` counts dynamic sampling's extra rounds."""
    seed = derive_seed(cfg.trainer.seed, iteration, "rollout", *([round_] if round_ else []))
    greedy = resolve(cfg.algorithm).needs_baseline
    pool = workers.pool
    if pool is None:  # colocated: the engine is the policy's own module, never stale
        return workers.call("rollout", "generate", rows, sampling_params(cfg), seed, iteration, version, greedy)
    restarts = pool.restarts
    if cfg.engine.health_check:
        pool.health_check()
    ensure_current(workers, version)
    seeds = [seed] if len(pool.actors) == 1 else [derive_seed(seed, "engine", k) for k in range(len(pool.actors))]
    load = [len(prompt_text(r["prompt"])) for r in rows]
    batch = pool.generate(rows, load, (sampling_params(cfg), iteration, version, greedy), seeds, workers.timeout_s)
    batch.meta["engine_restarts"] = pool.restarts - restarts
    if pool.restarts != restarts:
        workers.refresh_pid("rollout")
    return batch


@stage(name="reward")
def score_rewards(batch: Batch, tokenizer, cfg: Config, workers: Workers | None = None
                  ) -> tuple[Batch, dict[str, float]]:
    """Decode responses and score them with the scorer of each row's data_source (plus DAPO's overlong
    penalty, and the greedy baseline's score for remax); with reward_model.path, the reward model's actor
    scores prompt + response too and the two are mixed by reward_model.rule_weight / model_weight."""
    algo = resolve(cfg.algorithm)
    max_len = cfg.engine.max_new_tokens
    overlong = (max_len, round(algo.overlong_buffer_frac * max_len), cfg.algorithm.overlong_penalty_factor)
    baseline = decode_responses(tokenizer, batch, "baseline_responses", "baseline_mask") \
        if "baseline_responses" in batch.tensors else None
    texts = decode_responses(tokenizer, batch)
    model_scores = None
    if cfg.reward_model.path:
        if workers is None or workers.reward_model is None:
            raise RuntimeError("reward_model.path is set but no reward-model actor was started")
        prompts = decode_responses(tokenizer, batch, "prompts", "prompt_mask", skip_special_tokens=False)
        model_scores = workers.call("reward_model", "score", prompts, texts)
    return add_rewards(batch, texts, cfg, overlong, baseline, ray_workers.score_in_worker, model_scores)


@stage(name="old-log-prob")
def prepare_batch(workers: Workers, batch: Batch) -> tuple[Batch, dict[str, float]]:
    """Old and reference log-probs and critic values, when the advantages or the update need them; with
    per-stage seconds. A separate reference actor (trainer.ref_placement=separate) computes its log-probs."""
    if workers.reference is not None:
        start = time.perf_counter()
        batch = batch.union(ref_logprobs=workers.call("reference", "logprobs", batch))
        ref_s = time.perf_counter() - start
        batch, timings = workers.call("policy", "prepare", batch)
        return batch, {**timings, "timing_s/ref": ref_s}
    return workers.call("policy", "prepare", batch)


@stage(name="adv")
def compute_advantages(batch: Batch, cfg: Config, kl_coef: float | None = None) -> tuple[Batch, dict[str, float]]:
    """Advantages by the preset's estimator; kl_coef subtracts the KL to the reference from the rewards."""
    return add_advantages(batch, resolve(cfg.algorithm), kl_coef, cfg.algorithm.kl_penalty)


@stage(name="update-critic")
def update_critic(workers: Workers, batch: Batch) -> dict[str, float]:
    return workers.call("policy", "update_critic", batch)


@stage(name="update-actor")
def update_policy(workers: Workers, batch: Batch) -> tuple[dict[str, float], int]:
    """One policy update on the workers, then its weights into the rollout engine; returns the update's
    metrics (timing_s/update_actor and timing_s/update_weights among them) and the new weights version.

    One task, not two: each task run costs the Prefect server ~20 ms of CPU. The update is never retried (it
    would step twice); a push that fails because the rollout actor died is not an error of the update: Ray
    restarts that actor and `ensure_current` gives it these weights before it samples again."""
    start = time.perf_counter()
    metrics = workers.call("policy", "update", batch)
    synced = time.perf_counter()
    try:
        version = push_weights(workers)
    except Exception as exc:
        if not is_transient(exc):
            raise
        logger().warning("weights not pushed to the rollout engine (%s); it gets them before it samples",
                         type(exc).__name__)
        version = workers.call("policy", "state")["version"]
    done = time.perf_counter()
    return {**metrics, "timing_s/update_actor": synced - start, "timing_s/update_weights": done - synced}, version


def push_weights(workers: Workers) -> int:
    """The policy's weights into the rollout engine through the object store; returns their version."""
    return workers.push_weights()


def ensure_current(workers: Workers, version: int) -> None:
    """A rollout actor that Ray restarted after it died comes back with the SFT weights (version 0): give it
    the policy's current weights before it samples, so a stale engine is never sampled."""
    stale = workers.stale_engines(version)
    if stale:
        logger().warning("%d rollout engine(s) hold stale weights (restarted?); pushing version %d", len(stale),
                         version)
        workers.refresh_pid("rollout")
        workers.push_weights_to(stale)


@stage(name="update-weights", retry_condition_fn=retry_transient, **RETRY_TRANSIENT)
def sync_weights(workers: Workers) -> int:
    """Push the policy's weights to the rollout engine through the object store; returns their version (after
    a restore; each iteration's update pushes its own)."""
    return push_weights(workers)


@stage(name="testing", retry_condition_fn=retry_transient, **RETRY_TRANSIENT)
def evaluate_policy(workers: Workers, rows: list[dict], cfg: Config) -> dict[str, float]:
    """Greedy accuracy and mean@k / pass@k on the held-out rows with the current weights."""
    rows = rows[:cfg.trainer.eval_size] if cfg.trainer.eval_size else rows
    ensure_current(workers, workers.call("policy", "state")["version"])
    scorers = scorers_for([r["data_source"] for r in rows], cfg)  # resolved here, where the config's paths are
    return workers.call("rollout", "evaluate", rows, cfg, cfg.trainer.eval_k, cfg.engine.max_new_tokens,
                        derive_seed(cfg.trainer.seed, "eval"), cfg.engine.temperature or 1.0, scorers=scorers)
