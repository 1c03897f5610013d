"""The run plan: everything a training run decides from its Config, decided once, in the driver.

`make_plan(cfg)` resolves the algorithm preset (the only place that does), the sampling, update, parallel,
engine, multi-turn, reward and evaluation settings and the placement of the workers. Each worker receives its
own slice (PolicySettings, RolloutSettings, ReferenceSettings) and nothing downstream reads the Config again.
"""

from __future__ import annotations

from dataclasses import dataclass

from components.algorithms.presets import ResolvedAlgorithm, resolve
from components.config.schema import (
    Config,
    CriticConfig,
    MemoryOptimConfig,
    MixedPrecisionConfig,
    ModelConfig,
    OptimizerConfig,
)
from components.data.prompts import PromptSettings
from components.models.lora import LoraSettings
from components.rollout.base import SamplingParams
from components.rollout.completions import EngineOptions
from components.rollout.multi_turn import MultiTurnSettings
from components.rollout.worker import RolloutSettings


def resolve_algorithm(cfg: Config) -> ResolvedAlgorithm:
    """The algorithm preset with the user's keys over it (KeyError naming a bad name): the one resolution."""
    return resolve(cfg.algorithm)


@dataclass(frozen=True)
class ParallelPlan:
    """How several policy workers share the update (trainer.strategy and its knobs)."""

    strategy: str = "ddp"
    data_parallel_size: int | None = None
    zero_stage: int = 2
    grad_compression: str = "auto"
    compression_fp16_below_gbps: float = 2.0
    compression_powersgd_below_gbps: float = 0.2
    simulated_bandwidth_gbps: float | None = None
    tensor_parallel_size: int = 1  # actor.tensor_model_parallel_size: workers that split each layer
    sequence_parallel: bool = (
        False  # actor.sequence_parallel: activations between blocks split over the sequence
    )
    pipeline_parallel_size: int = 1  # actor.pipeline_model_parallel_size: stages, one worker each
    pipeline_microbatches: int = 1
    pipeline_schedule: str = "1f1b"


@dataclass(frozen=True)
class PolicySettings:
    """What a policy worker is built from: the policy, its optimizer and update, the critic, the reference,
    precision and memory options, and (colocated) the rollout engine it serves."""

    model: ModelConfig
    optimizer: OptimizerConfig
    algorithm: ResolvedAlgorithm
    update: object  # components.training.actor.UpdateSettings (imported lazily: torch)
    mixed_precision: MixedPrecisionConfig
    memory: MemoryOptimConfig
    parallel: ParallelPlan
    critic: CriticConfig | None = None  # None: no critic (the estimator needs no values)
    reference: bool = False  # a frozen reference beside the policy (KL loss or KL in reward, colocated)
    need_old: bool = False  # old log-probs even on-policy (KL in reward)
    seed: int = 0
    num_threads: int = 2
    rollout: RolloutSettings | None = None  # colocated: policy worker 0 also serves the rollout engine
    checkpoint_format: str = "full"  # trainer.checkpoint_format: full (gathered on rank 0) or sharded
    lora: LoraSettings = LoraSettings()  # actor.lora: adapters over the frozen policy (rank 0: none)
    lora_merge_on_sync: bool = (
        False  # engine.lora_merge_on_sync: the engine gets merged weights, not adapters
    )


@dataclass(frozen=True)
class ReferenceSettings:
    """The frozen reference in an actor of its own (trainer.ref_placement=separate)."""

    model: ModelConfig
    temperature: float
    micro_batch_size: int | None
    num_threads: int


@dataclass(frozen=True)
class RewardSettings:
    """How scores become rewards."""

    overlong: tuple[int, int, float]  # DAPO: (max_new_tokens, buffer tokens, penalty factor); buffer 0 = off
    rule_weight: float = 1.0
    model_weight: float = 1.0
    max_invalid_frac: float = 0.5
    kl_penalty: str = "k1"
    concurrency: int = 2  # sandbox.concurrency: sandboxed scorers at once


@dataclass(frozen=True)
class EvalSettings:
    """Held-out evaluation: greedy accuracy and mean@k / pass@k."""

    k: int
    size: int | None
    max_new_tokens: int
    seed: int
    temperature: float


@dataclass(frozen=True)
class Placement:
    """Where the actors go (trainer.num_workers, *_placement, engine.num_engines, worker resources)."""

    num_workers: int
    min_workers: int
    worker_resources: dict
    rollout_placement: str  # auto | colocate | separate
    separate_reference: bool
    num_engines: int
    engine_gpus: float
    health_check: bool
    health_check_timeout_s: float
    stage_timeout_s: float
    reward_model: str | None  # reward_model.path
    reward_model_dtype: str = "float32"
    reward_model_batch_size: int = 32
    trust_remote_code: bool = False  # actor.model.trust_remote_code: for the reward model's directory too
    overlap: bool = False  # an asynchronous mode: the engine samples while the policy updates

    def colocated(self, n: int, engine_type: str) -> bool:
        """The rollout engine in policy worker 0: asked for, or auto with one worker and one hf engine in the
        synchronous loop (an engine that samples during the update needs weights of its own)."""
        return self.rollout_placement == "colocate" or (
            self.rollout_placement == "auto"
            and n == 1
            and engine_type == "hf"
            and self.num_engines == 1
            and not self.overlap
        )


@dataclass(frozen=True)
class RunPlan:
    algorithm: ResolvedAlgorithm
    sampling: SamplingParams
    policy: PolicySettings
    rollout: RolloutSettings
    reference: ReferenceSettings | None
    placement: Placement
    rewards: RewardSettings
    evaluation: EvalSettings
    seed: int
    batch_size: int
    shuffle: bool
    iterations: int
    test_interval: int
    save_interval: int
    max_gen_rounds: int  # dynamic sampling's generation rounds per iteration
    kl_in_reward: tuple[float, str, float, int] | None  # (start, fixed|adaptive, target, horizon)
    max_worker_rebuilds: int
    params: dict  # the config flattened, the preset's values filled in: the MLflow run's params
    async_mode: str = "sync"  # trainer.async_mode
    ahead: int = 0  # batches sampled ahead of the one the policy trains on (0: the synchronous loop)
    max_staleness: int = 1  # policy versions a sample may lag before it is dropped


def make_plan(cfg: Config) -> RunPlan:
    """Resolve everything a training run needs from its validated config, once."""
    from components.training.actor import update_settings

    algo = resolve_algorithm(cfg)
    a, e, t, m = cfg.algorithm, cfg.engine, cfg.trainer, cfg.actor.model
    lora = LoraSettings.from_config(cfg.actor.lora)
    # asynchronous: the engine samples while the policy updates, so they split the threads (two torch pools
    # each as wide as the cores spin against each other: measured up to 10x slower steps on 2 cores)
    engine_threads, policy_threads = t.num_threads, t.num_threads
    if t.async_mode != "sync" and t.num_threads > 1:
        engine_threads = t.num_threads // 2
        policy_threads = t.num_threads - engine_threads
    rollout = RolloutSettings(
        m.path,
        e.type,
        EngineOptions.from_config(cfg),
        engine_threads,
        MultiTurnSettings.from_config(cfg),
        PromptSettings.from_config(cfg),
        # an engine of its own holds the same adapters over the base, and receives only them
        lora=lora if lora.enabled and not e.lora_merge_on_sync else None,
        partial=t.partial_rollouts,
    )
    placement = Placement(
        num_workers=t.num_workers,
        min_workers=t.min_workers,
        worker_resources=dict(t.worker_resources),
        rollout_placement=t.rollout_placement,
        separate_reference=algo.needs_reference and t.ref_placement == "separate",
        num_engines=e.num_engines,
        engine_gpus=e.num_gpus
        if e.num_gpus is not None
        else (0 if e.type == "hf" else e.tensor_parallel_size),
        health_check=e.health_check,
        health_check_timeout_s=e.health_check_timeout_s,
        stage_timeout_s=float(t.stage_timeout_s),
        reward_model=cfg.reward_model.path,
        reward_model_dtype=cfg.reward_model.dtype,
        reward_model_batch_size=cfg.reward_model.batch_size,
        trust_remote_code=cfg.actor.model.trust_remote_code,
        overlap=t.async_mode != "sync",
    )
    policy = PolicySettings(
        model=m,
        optimizer=cfg.actor.optimizer,
        algorithm=algo,
        update=update_settings(cfg, algo),
        mixed_precision=cfg.mixed_precision,
        memory=cfg.memory_optim,
        parallel=ParallelPlan(
            t.strategy,
            t.data_parallel_size,
            t.zero_stage,
            t.grad_compression,
            t.compression_fp16_below_gbps,
            t.compression_powersgd_below_gbps,
            t.simulated_bandwidth_gbps,
            cfg.actor.tensor_model_parallel_size,
            cfg.actor.sequence_parallel,
            cfg.actor.pipeline_model_parallel_size,
            cfg.actor.pipeline_microbatches or cfg.actor.pipeline_model_parallel_size,
            cfg.actor.pipeline_schedule,
        ),
        critic=cfg.critic if algo.needs_critic else None,
        reference=algo.needs_reference and t.ref_placement == "colocate",
        # the correction's target; asynchronous: the PPO ratio is taken to the policy that trains, not the
        # older one that sampled
        need_old=a.use_kl_in_reward or algo.rollout_correction != "none" or t.async_mode != "sync",
        seed=t.seed,
        num_threads=policy_threads,
        rollout=rollout,
        checkpoint_format=t.checkpoint_format,
        lora=LoraSettings.from_config(cfg.actor.lora),
        lora_merge_on_sync=e.lora_merge_on_sync,
    )
    reference = (
        ReferenceSettings(m, e.temperature or 1.0, cfg.actor.ppo_micro_batch_size, t.num_threads)
        if placement.separate_reference
        else None
    )
    max_len = e.max_new_tokens
    return RunPlan(
        algorithm=algo,
        sampling=SamplingParams(
            n=e.n, temperature=e.temperature, top_p=e.top_p, top_k=e.top_k, max_new_tokens=e.max_new_tokens
        ),
        policy=policy,
        rollout=rollout,
        reference=reference,
        placement=placement,
        rewards=RewardSettings(
            (max_len, round(algo.overlong_buffer_frac * max_len), a.overlong_penalty_factor),
            cfg.reward_model.rule_weight,
            cfg.reward_model.model_weight,
            cfg.reward.max_invalid_frac,
            a.kl_penalty,
            cfg.sandbox.concurrency,
        ),
        evaluation=EvalSettings(t.eval_k, t.eval_size, e.max_new_tokens, t.seed, e.temperature or 1.0),
        seed=t.seed,
        batch_size=cfg.data.batch_size,
        shuffle=cfg.data.shuffle,
        iterations=t.iterations,
        test_interval=t.test_interval,
        save_interval=t.save_interval,
        max_gen_rounds=a.max_num_gen_batches,
        kl_in_reward=(a.kl_coef, a.kl_ctrl, a.kl_target, a.kl_horizon) if a.use_kl_in_reward else None,
        max_worker_rebuilds=t.max_worker_rebuilds,
        params=run_params(cfg, algo),
        async_mode=t.async_mode,
        ahead=staleness_bound(t) if t.async_mode != "sync" else 0,
        max_staleness=staleness_bound(t),
    )


def staleness_bound(t) -> int:
    """trainer.max_staleness resolved: one_step_off is exactly 1, unset is 1."""
    return 1 if t.async_mode == "one_step_off" or t.max_staleness is None else t.max_staleness


def run_params(cfg: Config, algo: ResolvedAlgorithm) -> dict:
    """The config as flat params, each algorithm key at the value the run uses (a preset's, where unset)."""
    from dataclasses import asdict

    from components.config import flatten

    params = flatten(cfg)
    for key, value in asdict(algo).items():
        if params.get(f"algorithm.{key}") is None:
            params[f"algorithm.{key}"] = value
    return params
