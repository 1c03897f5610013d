"""Every settings type the run plan builds and the workers receive, in one torch-free module.

Each type is a frozen dataclass built from the validated Config by its own `from_config` (those that depend on
the algorithm take the resolved preset too), so `make_plan` (components/plan.py) is a list of them. A worker
gets only its slice: a rollout worker its RolloutSettings, a policy worker its PolicySettings, the reference
its ReferenceSettings. Nothing here imports torch, Ray or a worker module: the driver, the config checks and
the workers all read these types without loading what the others need.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from components.algorithms.presets import ResolvedAlgorithm
    from components.config.schema import (
        Config,
        CriticConfig,
        MemoryOptimConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimizerConfig,
        SandboxConfig,
    )


# ---- rollout -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # besides EOS: a sequence ends after sampling one of these

    @classmethod
    def from_config(cls, cfg: Config) -> SamplingParams:
        e = cfg.engine
        return cls(
            n=e.n, temperature=e.temperature, top_p=e.top_p, top_k=e.top_k, max_new_tokens=e.max_new_tokens
        )


@dataclass(frozen=True)
class EngineOptions:
    """Settings a GPU engine is built with (from `engine.*` and `actor.model.*`)."""

    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 4096
    sleep_during_update: bool = False  # free the KV cache while the policy updates (colocated on one GPU)
    seed: int = 0
    enforce_eager: bool = False
    attention_implementation: str = "sdpa"  # the hf engine's
    # the policy's adapters' rank when the engine receives adapters alone (vllm, sglang): its slots
    lora_rank: int = 0
    # the adapters' target modules (actor.lora.target_modules) where the engine reserves their slots up front
    # (sglang); "all-linear" = every linear layer of the decoder
    lora_targets: tuple[str, ...] | str = "all-linear"
    trust_remote_code: bool = False  # actor.model.trust_remote_code: run the model directory's own code

    @classmethod
    def from_config(cls, cfg: Config) -> EngineOptions:
        e, m = cfg.engine, cfg.actor.model
        return cls(
            dtype=m.dtype,
            tensor_parallel_size=e.tensor_parallel_size,
            gpu_memory_utilization=e.gpu_memory_utilization,
            max_model_len=m.max_seq_len,
            sleep_during_update=e.sleep_during_update,
            seed=cfg.trainer.seed,
            attention_implementation=m.attention_implementation,
            lora_rank=0 if e.lora_merge_on_sync else cfg.actor.lora.rank,
            lora_targets=_targets(cfg.actor.lora.target_modules),
            trust_remote_code=m.trust_remote_code,
        )


@dataclass(frozen=True)
class SandboxLimits:
    """The bubblewrap sandbox's limits (sandbox.*), each for the whole process tree of one run."""

    timeout_s: float = 10.0  # wall clock, then the whole process group is killed
    cpu_s: int = 5  # CPU-seconds of the whole process tree (RLIMIT_CPU per process too)
    memory_mb: int = 512  # resident memory of the whole tree (RLIMIT_AS per process too)
    max_processes: int = 16  # processes of the tree (RLIMIT_NPROC of the leased uid)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # RLIMIT_FSIZE: stdout, stderr and any file written in /tmp
    tmp_mb: int = 64  # size of the private tmpfs
    allowed_packages: tuple[str, ...] = ()  # importable besides the standard library

    @classmethod
    def from_config(cls, s: SandboxConfig) -> SandboxLimits:
        return cls(
            timeout_s=s.timeout_s,
            cpu_s=s.cpu_s,
            memory_mb=s.memory_mb,
            max_processes=s.max_processes,
            max_open_files=s.max_open_files,
            max_output_bytes=s.max_output_bytes,
            allowed_packages=tuple(s.allowed_packages),
        )


@dataclass(frozen=True)
class MultiTurnSettings:
    max_turns: int
    tools: tuple[str, ...]
    max_tool_chars: int
    sandbox_limits: SandboxLimits | None = None  # for the python tool
    concurrency: int = 2
    env: str = "tools"  # the environment each sample is an episode of (components/envs ENVS)
    game: str = "GuessTheNumber-v0"  # env=textarena: the game's env id
    step_timeout_s: float = 60.0  # an environment's reset or step that takes longer stops the rollout
    agent: str | None = None  # env=agent: the agent program, file.py:function
    eos_token: str | None = (
        None  # the policy tokenizer's, set by the rollout worker (an agent's reply ends there)
    )
    envs: tuple[tuple[str, str], ...] = ()  # a mixture: (data_source pattern, environment), first match wins

    def env_of(self, data_source: str) -> str:
        """The environment a row of `data_source` plays: the first multi_turn.envs pattern it matches, else
        multi_turn.env."""
        return next((e for p, e in self.envs if fnmatch.fnmatchcase(data_source, p)), self.env)

    @property
    def played(self) -> tuple[str, ...]:
        """Every environment a row may play, multi_turn.env first."""
        return tuple(dict.fromkeys([self.env, *(e for _, e in self.envs)]))

    @classmethod
    def from_config(cls, cfg: Config) -> MultiTurnSettings | None:
        m = cfg.multi_turn
        if not m.enable:
            return None
        return cls(
            m.max_turns,
            tuple(m.tools),
            m.max_tool_response_chars,
            SandboxLimits.from_config(cfg.sandbox),
            cfg.sandbox.concurrency,
            m.env,
            m.game,
            m.step_timeout_s,
            m.agent,
            envs=tuple(m.envs.items()),
        )


MESSAGES = "messages"  # a prompt given as chat messages (the other form: a plain string)


@dataclass(frozen=True)
class PromptSettings:
    """How prompts become token ids: `data.apply_chat_template` (None = messages yes, strings no)."""

    apply_chat_template: bool | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> PromptSettings:
        return cls(cfg.data.apply_chat_template)

    def templated(self, form: str) -> bool:
        """Whether a prompt of this form goes through the chat template."""
        return form == MESSAGES if self.apply_chat_template is None else self.apply_chat_template


@dataclass(frozen=True)
class LoraSettings:
    """actor.lora (or critic.lora), resolved: rank 0 = full fine-tuning."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"
    init: str = "default"

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @classmethod
    def from_config(cls, c) -> LoraSettings:
        return cls(c.rank, c.alpha, c.dropout, _targets(c.target_modules), c.init)


def _targets(modules) -> tuple[str, ...] | str:
    return modules if isinstance(modules, str) else tuple(modules)


def thread_split(cfg: Config) -> tuple[int, int]:
    """(engine threads, policy threads). Asynchronous: the engine samples while the policy updates, so they
    split the threads (two torch pools each as wide as the cores spin against each other: measured up to 10x
    slower steps on 2 cores)."""
    t = cfg.trainer
    if t.async_mode == "sync" or t.num_threads <= 1:
        return t.num_threads, t.num_threads
    engine = t.num_threads // 2
    return engine, t.num_threads - engine


@dataclass(frozen=True)
class RolloutSettings:
    """What a rollout worker is built from (the run plan's slice for it)."""

    model_path: str
    engine_type: str = "hf"
    options: EngineOptions = field(default_factory=lambda: EngineOptions(dtype="float32"))
    num_threads: int = 2
    multi_turn: MultiTurnSettings | None = None
    prompts: PromptSettings = field(default_factory=PromptSettings)
    lora: LoraSettings | None = None  # the policy's adapters, which this engine's copy holds and receives
    # trainer.partial_rollouts: an update that arrives during a training rollout stops its samples where they
    # are, and they are finished with the new weights (else the update waits for the rollout's end)
    partial: bool = False

    @classmethod
    def from_config(cls, cfg: Config) -> RolloutSettings:
        lora = LoraSettings.from_config(cfg.actor.lora)
        return cls(
            cfg.actor.model.path,
            cfg.engine.type,
            EngineOptions.from_config(cfg),
            thread_split(cfg)[0],
            MultiTurnSettings.from_config(cfg),
            PromptSettings.from_config(cfg),
            # an engine of its own holds the same adapters over the base, and receives only them
            lora=lora if lora.enabled and not cfg.engine.lora_merge_on_sync else None,
            partial=cfg.trainer.partial_rollouts,
        )


# ---- update --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossParams:
    clip_low: float = 0.2  # 1 - clip_low is the lower ratio bound
    clip_high: float = 0.2  # 1 + clip_high is the upper ratio bound (DAPO: larger)
    clip_ratio_c: float = 3.0  # dual clip for negative advantages
    agg_mode: str = "token-mean"
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature for positive advantages
    sapo_tau_neg: float = 1.05  # ... and for the others
    clip_cov_ratio: float = 2e-4  # Clip-Cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # Clip-Cov: the covariance band tokens are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3  # KL-Cov: fraction of tokens penalised
    kl_cov_coef: float = 1.0  # KL-Cov: the penalty's coefficient
    seed: int = 0  # Clip-Cov's draw

    @classmethod
    def from_config(cls, cfg: Config, algo: ResolvedAlgorithm) -> PolicyLossParams:
        a = cfg.algorithm
        return cls(
            a.clip_epsilon,
            algo.clip_ratio_high,
            a.clip_ratio_c,
            algo.loss_agg_mode,
            sapo_tau_pos=a.sapo_tau_pos,
            sapo_tau_neg=a.sapo_tau_neg,
            clip_cov_ratio=a.clip_cov_ratio,
            clip_cov_lb=a.clip_cov_lb,
            clip_cov_ub=a.clip_cov_ub,
            kl_cov_ratio=a.kl_cov_ratio,
            kl_cov_coef=a.kl_cov_coef,
            seed=cfg.trainer.seed,
        )


@dataclass(frozen=True)
class LoopSettings:
    ppo_epochs: int = 1
    mini_batch_size: int | None = None  # global rows per optimizer step; None = the whole batch
    micro_batch_size: int | None = None  # rows per forward pass; None = the whole mini-batch
    max_tokens: int | None = None  # pack micro-batches to this many padded tokens instead (per worker)
    grad_clip: float = 1.0
    norm_const: float = 1.0  # seq-mean-token-sum-norm constant (max response length)
    seed: int = 0

    @classmethod
    def from_config(cls, cfg: Config) -> LoopSettings:
        a = cfg.actor
        return cls(
            ppo_epochs=a.ppo_epochs,
            mini_batch_size=a.ppo_mini_batch_size,
            micro_batch_size=a.ppo_micro_batch_size,
            max_tokens=a.ppo_max_token_len_per_worker,
            grad_clip=a.optimizer.grad_clip,
            norm_const=float(cfg.engine.max_new_tokens),
            seed=cfg.trainer.seed,
        )


@dataclass(frozen=True)
class UpdateSettings:
    loop: LoopSettings = field(default_factory=LoopSettings)  # epochs, mini/micro-batches, grad clip, seed
    temperature: float = 1.0
    beta: float = 0.0  # KL-to-reference loss coefficient (kl_loss_coef); 0 = no KL term
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    policy_loss: str = "vanilla"
    loss: PolicyLossParams = field(default_factory=PolicyLossParams)
    autocast_dtype: str | None = None  # "bf16" / "fp16": autocast the update's forward passes
    router_replay: bool = False  # an MoE policy's forwards take the experts the rollout recorded (R3)
    jsd_coef: float = 0.0  # distill.loss=jsd: weight of GKD's generalised JSD to the teacher in the loss
    jsd_beta: float = 0.5

    @classmethod
    def from_config(cls, cfg: Config, algo: ResolvedAlgorithm) -> UpdateSettings:
        """The update of the config's actor under the resolved algorithm (autocast as configured; on FSDP's
        parameter dtype the policy worker turns it off)."""
        a = cfg.algorithm
        return cls(
            loop=LoopSettings.from_config(cfg),
            temperature=cfg.engine.temperature or 1.0,
            beta=a.kl_loss_coef if algo.use_kl_loss else 0.0,
            kl_loss_type=algo.kl_loss_type,
            entropy_coeff=a.entropy_coeff,
            policy_loss=algo.policy_loss,
            loss=PolicyLossParams.from_config(cfg, algo),
            autocast_dtype=cfg.mixed_precision.dtype if cfg.mixed_precision.enabled else None,
            router_replay=cfg.actor.router_replay == "R3",
            jsd_coef=cfg.distill.coef if cfg.distill.teacher_path and cfg.distill.loss == "jsd" else 0.0,
            jsd_beta=cfg.distill.jsd_beta,
        )


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
    sequence_parallel: bool = False  # actor.sequence_parallel: activations between blocks split over tokens
    pipeline_parallel_size: int = 1  # actor.pipeline_model_parallel_size: stages, one worker each
    pipeline_microbatches: int = 1
    pipeline_schedule: str = "1f1b"

    @classmethod
    def from_config(cls, cfg: Config) -> ParallelPlan:
        t, a = cfg.trainer, cfg.actor
        return cls(
            t.strategy,
            t.data_parallel_size,
            t.zero_stage,
            t.grad_compression,
            t.compression_fp16_below_gbps,
            t.compression_powersgd_below_gbps,
            t.simulated_bandwidth_gbps,
            a.tensor_model_parallel_size,
            a.sequence_parallel,
            a.pipeline_model_parallel_size,
            a.pipeline_microbatches or a.pipeline_model_parallel_size,
            a.pipeline_schedule,
        )

    @property
    def replica_size(self) -> int:
        """Consecutive ranks that split one replica (tensor x pipeline)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class PolicySettings:
    """What a policy worker is built from: the policy, its optimizer and update, the critic, the reference,
    precision and memory options, and (colocated) the rollout engine it serves."""

    model: ModelConfig
    optimizer: OptimizerConfig
    algorithm: ResolvedAlgorithm
    update: UpdateSettings
    mixed_precision: MixedPrecisionConfig
    memory: MemoryOptimConfig
    parallel: ParallelPlan
    critic: CriticConfig | None = None  # None: no critic (the estimator needs no values)
    reference: bool = False  # a frozen reference beside the policy (KL loss or KL in reward, colocated)
    teacher: ModelConfig | None = None  # on-policy distillation: the teacher, beside the policy
    need_old: bool = False  # old log-probs even on-policy (KL in reward)
    seed: int = 0
    num_threads: int = 2
    rollout: RolloutSettings | None = None  # colocated: policy worker 0 also serves the rollout engine
    checkpoint_format: str = "full"  # trainer.checkpoint_format: full (gathered on rank 0) or sharded
    lora: LoraSettings = LoraSettings()  # actor.lora: adapters over the frozen policy (rank 0: none)
    lora_merge_on_sync: bool = False  # engine.lora_merge_on_sync: the engine gets merged weights

    @classmethod
    def from_config(cls, cfg: Config, algo: ResolvedAlgorithm) -> PolicySettings:
        t, a = cfg.trainer, cfg.algorithm
        return cls(
            model=cfg.actor.model,
            optimizer=cfg.actor.optimizer,
            algorithm=algo,
            update=UpdateSettings.from_config(cfg, algo),
            mixed_precision=cfg.mixed_precision,
            memory=cfg.memory_optim,
            parallel=ParallelPlan.from_config(cfg),
            critic=cfg.critic if algo.needs_critic else None,
            reference=algo.needs_reference and t.ref_placement == "colocate",
            # the correction's target; asynchronous: the PPO ratio is taken to the policy that trains, not the
            # older one that sampled
            need_old=a.use_kl_in_reward
            or algo.rollout_correction != "none"
            or t.async_mode != "sync"
            or cfg.distill.teacher_path is not None,  # distillation's advantages compare the student's
            teacher=teacher_model(cfg) if cfg.distill.placement == "colocate" else None,
            seed=t.seed,
            num_threads=thread_split(cfg)[1],
            rollout=RolloutSettings.from_config(cfg),
            checkpoint_format=t.checkpoint_format,
            lora=LoraSettings.from_config(cfg.actor.lora),
            lora_merge_on_sync=cfg.engine.lora_merge_on_sync,
        )


@dataclass(frozen=True)
class DistillSettings:
    """On-policy distillation (distill.*): the advantage of a token is coef x (teacher - student log-prob)
    plus task_coef x the estimator's advantage of the task reward."""

    coef: float = 1.0  # the reverse-KL advantages' weight (0 with distill.loss=jsd: the loss carries it)
    task_coef: float = 0.0

    @classmethod
    def from_config(cls, cfg: Config) -> DistillSettings | None:
        """None unless a teacher is set."""
        d = cfg.distill
        if d.teacher_path is None:
            return None
        return cls(d.coef if d.loss == "reverse_kl" else 0.0, d.task_coef)


def teacher_model(cfg: Config) -> ModelConfig | None:
    """The teacher as it is loaded: the actor's model settings at distill.teacher_path (None: no teacher)."""
    if cfg.distill.teacher_path is None:
        return None
    return cfg.actor.model.model_copy(update={"path": cfg.distill.teacher_path})


@dataclass(frozen=True)
class ReferenceSettings:
    """The frozen reference in an actor of its own (trainer.ref_placement=separate)."""

    model: ModelConfig
    temperature: float
    micro_batch_size: int | None
    num_threads: int

    @classmethod
    def from_config(cls, cfg: Config, algo: ResolvedAlgorithm) -> ReferenceSettings | None:
        """None unless the reference has an actor of its own."""
        if not (algo.needs_reference and cfg.trainer.ref_placement == "separate"):
            return None
        return cls._of(cfg, cfg.actor.model)

    @classmethod
    def teacher(cls, cfg: Config) -> ReferenceSettings | None:
        """On-policy distillation's teacher in an actor of its own (distill.placement=separate), else None:
        it scores the samples as the separate reference does."""
        model = teacher_model(cfg)
        return cls._of(cfg, model) if model is not None and cfg.distill.placement == "separate" else None

    @classmethod
    def _of(cls, cfg: Config, model: ModelConfig) -> ReferenceSettings:
        return cls(
            model, cfg.engine.temperature or 1.0, cfg.actor.ppo_micro_batch_size, cfg.trainer.num_threads
        )


# ---- rewards and evaluation ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardSettings:
    """How scores become rewards, and where they are computed."""

    overlong: tuple[int, int, float]  # DAPO: (max_new_tokens, buffer tokens, penalty factor); buffer 0 = off
    rule_weight: float = 1.0
    model_weight: float = 1.0
    max_invalid_frac: float = 0.5
    kl_penalty: str = "k1"
    concurrency: int = 2  # sandbox.concurrency: sandboxed scorers at once
    timeout_s: float = 1200.0  # trainer.stage_timeout_s: a scoring call that runs longer is killed

    @classmethod
    def from_config(cls, cfg: Config, algo: ResolvedAlgorithm) -> RewardSettings:
        a, max_len = cfg.algorithm, cfg.engine.max_new_tokens
        return cls(
            (max_len, round(algo.overlong_buffer_frac * max_len), a.overlong_penalty_factor),
            cfg.reward_model.rule_weight,
            cfg.reward_model.model_weight,
            cfg.reward.max_invalid_frac,
            a.kl_penalty,
            cfg.sandbox.concurrency,
            float(cfg.trainer.stage_timeout_s),
        )


@dataclass(frozen=True)
class EvalSettings:
    """Held-out evaluation: greedy accuracy and mean@k / pass@k."""

    k: int
    size: int | None
    max_new_tokens: int
    seed: int
    temperature: float

    @classmethod
    def from_config(cls, cfg: Config) -> EvalSettings:
        t, e = cfg.trainer, cfg.engine
        return cls(t.eval_k, t.eval_size, e.max_new_tokens, t.seed, e.temperature or 1.0)


# ---- placement -----------------------------------------------------------------------------------------


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
    rollout_resources: dict = field(default_factory=dict)  # custom resources of each engine actor
    backend: str = "ray"  # trainer.backend: Ray actors, or every worker in the driver's process
    separate_teacher: bool = False  # distill.placement=separate: the teacher takes a worker's resources
    ray_start_timeout_s: float = 120.0  # trainer.ray_start_timeout_s: a local Ray instance's start

    @classmethod
    def from_config(cls, cfg: Config, algo: ResolvedAlgorithm) -> Placement:
        e, t = cfg.engine, cfg.trainer
        return cls(
            num_workers=t.num_workers,
            min_workers=t.num_workers if t.min_workers is None else t.min_workers,
            worker_resources=dict(t.worker_resources),
            rollout_resources=dict(t.rollout_resources),
            rollout_placement=t.rollout_placement,
            separate_reference=algo.needs_reference and t.ref_placement == "separate",
            separate_teacher=cfg.distill.teacher_path is not None and cfg.distill.placement == "separate",
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
            backend=t.backend,
            ray_start_timeout_s=t.ray_start_timeout_s,
        )

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
