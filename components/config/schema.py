"""Typed configuration: one pydantic model per section, one line of help per field.

Key names follow verl's guide (`algorithm.kl_loss_coef`, `actor.optimizer.lr`, `engine.n`, ...). Every model
forbids unknown keys, so a typo fails before any work starts; `components.config.load_config` turns the
pydantic error into one that names the key and the fix.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from components.config.names import ENV_NAMES, SCORER_NAMES, TOOL_NAMES, installed


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, values are checked on assignment, and every
    number is finite (a learning rate of inf, or 1e309, which YAML reads as inf, trains to NaN weights)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RolloutCorrectionConfig(Section):
    """Off-policy correction between the rollout engine's and the trainer's log-probs
    (components/algorithms/rollout_correction.py)."""

    mode: str = Field(
        "none",
        description="none, tis / mis (token-level truncated / masked importance sampling), seq_tis / seq_mis "
        "(sequence level), geo_mis (geometric-mean sequence mask), icepop (token band mask), offpolicy_mask "
        "(negative sequences past a divergence); join with + to combine (tis+icepop)",
    )
    cap: float = Field(2.0, gt=1, description="truncation cap, and the masked modes' band [1/cap, cap]")
    band_low: float = Field(0.5, gt=0, description="icepop: tokens with weight below this are masked")
    band_high: float = Field(5.0, gt=0, description="icepop: ... and above this")
    geo_low: float = Field(
        0.999, gt=0, description="geo_mis: sequences whose geometric-mean weight is below this are masked"
    )
    geo_high: float = Field(1.001, gt=0, description="geo_mis: ... and above this")
    offpolicy_threshold: float = Field(
        1e-4,
        ge=0,
        description="offpolicy_mask: negative-advantage sequences whose mean log(p_rollout / p_old) passes "
        "this are masked",
    )

    @model_validator(mode="after")
    def _bands(self) -> RolloutCorrectionConfig:
        for low, high in (("band_low", "band_high"), ("geo_low", "geo_high")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"algorithm.rollout_correction.{low}={getattr(self, low)} is above "
                    f"algorithm.rollout_correction.{high}={getattr(self, high)}: the band is empty; "
                    f"set {low} <= {high}"
                )
        return self


class AlgorithmConfig(Section):
    """Keys left as None take the preset's value (components/algorithms/presets.py); any key overrides it."""

    name: str = Field(
        "grpo",
        description="preset: grpo, ppo, dr_grpo, dapo, rloo, reinforce_plus_plus(_baseline), remax, gspo, "
        "sapo, gmpo, clip_cov, kl_cov, gpg, opd",
    )
    adv_estimator: str | None = Field(None, description="advantage estimator; None = the preset's")
    norm_adv_by_std: bool | None = Field(
        None, description="divide GRPO advantages by group std; None = preset"
    )
    gamma: float | None = Field(
        None, ge=0, le=1, description="discount for gae / reinforce_plus_plus; None = preset"
    )
    lam: float | None = Field(None, ge=0, le=1, description="GAE lambda; None = the preset's")
    policy_loss: str | None = Field(
        None,
        description="policy loss: vanilla, gspo, cispo, sapo, gmpo, clip_cov, kl_cov, gpg; None = the preset's",
    )
    loss_agg_mode: str | None = Field(None, description="loss aggregation; None = the preset's")
    clip_epsilon: float = Field(0.2, gt=0, lt=1, description="PPO clip range (verl: clip_ratio_low)")
    clip_ratio_high: float | None = Field(
        None, gt=0, description="upper clip (DAPO clip-higher); None = preset"
    )
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip bound for negative advantages")
    sapo_tau_pos: float = Field(1.0, gt=0, description="sapo: soft-gate temperature where the advantage > 0")
    sapo_tau_neg: float = Field(
        1.05, gt=0, description="sapo: soft-gate temperature where the advantage <= 0"
    )
    clip_cov_ratio: float = Field(
        2e-4, gt=0, le=1, description="clip_cov: fraction of the tokens whose gradient is cut"
    )
    clip_cov_lb: float = Field(1.0, description="clip_cov: tokens are drawn with covariance above this")
    clip_cov_ub: float = Field(5.0, description="clip_cov: ... and below this")
    kl_cov_ratio: float = Field(
        2e-3, gt=0, le=1, description="kl_cov: fraction of the tokens (top covariance) penalised"
    )
    kl_cov_coef: float = Field(1.0, ge=0, description="kl_cov: coefficient of the |log-ratio| penalty")
    use_kl_loss: bool | None = Field(
        None, description="add kl_loss_coef x KL(pi, pi_ref) to the loss; None = on when kl_loss_coef > 0"
    )
    kl_loss_coef: float = Field(
        0.0,
        ge=0,
        validation_alias=AliasChoices("kl_loss_coef", "beta"),
        description="KL-to-reference loss coefficient (TRL: beta; 0 = no reference)",
    )
    kl_loss_type: str = Field(
        "low_var_kl", description="KL estimator: k1, abs, mse/k2, low_var_kl/k3; `+` = straight-through"
    )
    use_kl_in_reward: bool = Field(False, description="subtract kl_coef x KL(old, ref) from token rewards")
    kl_penalty: str = Field("k1", description="KL estimator for the in-reward penalty")
    kl_ctrl: Literal["fixed", "adaptive"] = Field("fixed", description="in-reward KL coefficient controller")
    kl_coef: float = Field(
        0.001, ge=0, description="in-reward KL coefficient (the adaptive controller's start)"
    )
    kl_target: float = Field(0.1, gt=0, description="adaptive controller: target KL per token")
    kl_horizon: int = Field(10000, ge=1, description="adaptive controller: horizon in samples")
    entropy_coeff: float = Field(0.0, ge=0, description="entropy bonus coefficient")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="engine vs trainer off-policy correction"
    )
    dynamic_sampling: bool | None = Field(
        None, description="DAPO: drop groups with all-equal rewards and refill; None = preset"
    )
    max_num_gen_batches: int = Field(3, ge=1, description="dynamic sampling: generation rounds per iteration")
    overlong_buffer_frac: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="DAPO overlong penalty over the last "
        "fraction of engine.max_new_tokens (0 = off); None = preset",
    )
    overlong_penalty_factor: float = Field(1.0, ge=0, description="DAPO overlong penalty at max_new_tokens")

    @model_validator(mode="after")
    def _clip_cov_band(self) -> AlgorithmConfig:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"algorithm.clip_cov_lb={self.clip_cov_lb} is not below algorithm.clip_cov_ub="
                f"{self.clip_cov_ub}: the covariance band is empty; set clip_cov_lb < clip_cov_ub"
            )
        return self

    @property
    def beta(self) -> float:
        """TRL's name for kl_loss_coef."""
        return self.kl_loss_coef


class ModelConfig(Section):
    path: str = Field("checkpoints/sft", description="local Hugging Face causal-LM directory")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights dtype")
    max_seq_len: int = Field(64, gt=0, description="prompt + response token limit")
    attention_implementation: Literal["eager", "sdpa", "flash_attention_2"] = Field(
        "sdpa", description="attention kernel passed to transformers"
    )
    trust_remote_code: bool = Field(
        False,
        description="run a model directory's own Python code (its auto_map), for every model the run loads; "
        "off: such a directory is refused",
    )
    # a vision-language policy (docs/multimodal.md): SFT composes text_model and vision_model with the fusion
    # layers; training, rollout and evaluation then load the composed model from `path`
    type: Literal["text", "multimodal"] = Field("text", description="text: a causal LM; multimodal: a VLM")
    text_model: str | None = Field(
        None, description="multimodal SFT: local causal-LM directory to compose; None = the tiny text model"
    )
    vision_model: str | None = Field(
        None, description="multimodal SFT: local vision encoder (a CLIP ViT) directory; None = a tiny one"
    )
    fusion_method: Literal["projector", "cross_attention"] = Field(
        "projector", description="projector (LLaVA-style tokens) or cross_attention (gated, Flamingo-style)"
    )
    freeze_vision_model: bool = Field(False, description="vision tower parameters get no updates")
    vision_lr_ratio: float = Field(
        0.1, gt=0, le=1, description="the vision tower's learning rate as a fraction of the text model's"
    )
    vision_token_ratio: float = Field(
        0.5,
        gt=0,
        le=1,
        description="largest share of max_seq_len an image may take; images are pooled down to fit",
    )


class OptimizerConfig(Section):
    type: Literal["adamw", "adam", "sgd"] = Field("adamw", description="torch optimizer")
    # optimizers apply the rate in the weights' float32: a larger one overflows inside the step
    lr: float = Field(1e-4, gt=0, le=3.0e38, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps, then constant")
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm")


class LoraConfig(Section):
    """Low-rank adapters over the frozen policy (peft): rank 0 trains the whole model."""

    rank: int = Field(0, ge=0, description="adapter rank r; 0 = full fine-tuning")
    alpha: float = Field(16.0, gt=0, description="adapter scale alpha (the update is alpha / r x B A)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="linear layers that get adapters, by name (q_proj, v_proj, ...); all-linear = every linear "
        "layer of the decoder (not the LM head)",
    )
    init: Literal["default", "gaussian"] = Field(
        "default", description="adapter init (peft): A random, B zero, so the start is the base model"
    )
    quantization: Literal["none", "4bit", "8bit"] = Field(
        "none", description="QLoRA: the frozen base loaded in 4 or 8 bits (bitsandbytes, CUDA only)"
    )


class ActorConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="policy model")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="policy optimizer")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (rank 0: full weights)")
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    router_replay: Literal["disabled", "R3"] = Field(
        "disabled",
        description="an MoE policy: R3 replays the experts each token took at rollout in every training "
        "forward (the hf engine records them); disabled: the trainer routes by itself (the agreement is "
        "logged either way, moe/routing_agreement)",
    )
    ppo_mini_batch_size: int | None = Field(
        None, ge=1, description="responses per optimizer step; None = all"
    )
    ppo_micro_batch_size: int | None = Field(
        None, ge=1, description="responses per forward pass (grad accumulation)"
    )
    ppo_max_token_len_per_worker: int | None = Field(
        None,
        ge=1,
        description="pack micro-batches to this many "
        "padded tokens (rows sorted by length) instead of "
        "ppo_micro_batch_size rows; None = fixed count",
    )
    tensor_model_parallel_size: int = Field(
        1,
        ge=1,
        description="workers that split each decoder layer's matmuls (DTensor tensor parallelism, the "
        "architecture's own plan); trainer.num_workers = data parallel x this",
    )
    sequence_parallel: bool = Field(
        False,
        description="with tensor parallelism: activations between the blocks (norms, residual stream) split "
        "over the sequence across the TP workers (Megatron's sequence parallelism; Llama-family decoders)",
    )
    pipeline_model_parallel_size: int = Field(
        1,
        ge=1,
        description="pipeline stages (contiguous decoder layers; torch.distributed.pipelining); "
        "trainer.num_workers = data parallel x this x tensor_model_parallel_size; no critic",
    )
    pipeline_microbatches: int | None = Field(
        None,
        ge=1,
        description="micro-batches the schedule splits each update micro-batch into; None = the stages",
    )
    pipeline_schedule: Literal["gpipe", "1f1b"] = Field("1f1b", description="the pipeline schedule")

    @model_validator(mode="after")
    def _sequence_parallel_needs_tensor_parallel(self) -> ActorConfig:
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "actor.sequence_parallel=true splits the sequence over tensor-parallel workers, but "
                "actor.tensor_model_parallel_size=1; set it above 1, or sequence_parallel=false."
            )
        return self


class CriticConfig(Section):
    """The value model PPO (adv_estimator gae) trains beside the actor: the policy's backbone plus a value head."""

    model_path: str | None = Field(
        None, description="local HF model for the critic's backbone; None = the actor's"
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="critic optimizer")
    cliprange_value: float = Field(0.5, gt=0, description="clip of the value change around the old values")
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA adapters on the critic's backbone (its value head trains whole); rank 0: full weights",
    )


class EngineConfig(Section):
    type: Literal["hf", "vllm", "sglang", "trtllm"] = Field("hf", description="rollout engine")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="top-k sampling (0 = off)")
    n: int = Field(8, ge=1, description="completions sampled per prompt")
    max_new_tokens: int = Field(16, ge=1, description="response length limit")
    num_engines: int = Field(
        1,
        ge=1,
        description="data-parallel rollout engines (Ray actors); prompts are split "
        "across them by prompt tokens",
    )
    health_check: bool = Field(
        False,
        description="before each rollout every engine must answer a one-token "
        "generation within health_check_timeout_s, else it is restarted",
    )
    health_check_timeout_s: float = Field(
        60.0, gt=0, description="seconds an engine has to answer its health check"
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (vllm, sglang, trtllm)")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="share of a GPU an engine may fill with weights and KV cache"
    )
    num_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs reserved per engine actor; None = "
        "tensor_parallel_size (0 for hf); a fraction shares a GPU "
        "with the policy",
    )
    sleep_during_update: bool = Field(
        False,
        description="free the engine's KV cache (vLLM sleep, SGLang release) "
        "while the policy updates on the same GPU",
    )
    lora_merge_on_sync: bool = Field(
        False,
        description="with actor.lora: send the engine merged full weights after each update instead of the "
        "adapters alone (for engines without adapter support)",
    )


class RewardModelConfig(Section):
    """Rule scorers chosen by data_source (components/rewards/registry.py), and an optional learned reward model."""

    format_score: float = Field(0.0, description="reward for an extracted but wrong answer")
    method: Literal["strict", "flexible"] = Field("strict", description="GSM8K answer extraction")
    sources: dict[str, str] = Field(
        {},
        description="data_source -> scorer name (gsm8k, math, countdown, code), "
        "overriding the source's built-in scorer",
    )
    default_scorer: str | None = Field(
        None,
        description="scorer for a data_source with no built-in or override; None = such a row is an error",
    )
    path: str | None = Field(
        None, description="local Hugging Face sequence-classification reward model; None = rule rewards only"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="reward model weights dtype"
    )
    batch_size: int = Field(32, ge=1, description="prompt+response pairs per reward-model forward pass")
    rule_weight: float = Field(
        1.0, description="reward = rule_weight x rule score + model_weight x model score"
    )
    model_weight: float = Field(1.0, description="weight of the reward model's score (used when path is set)")

    @model_validator(mode="after")
    def _known_scorers(self) -> RewardModelConfig:
        for key, name in [
            *(("sources." + k, v) for k, v in self.sources.items()),
            ("default_scorer", self.default_scorer),
        ]:
            if name is not None and name not in SCORER_NAMES:
                raise ValueError(
                    f"reward_model.{key}={name!r}: no such scorer; use one of {', '.join(SCORER_NAMES)}"
                )
        return self


class RewardConfig(Section):
    """What a run accepts from its reward functions."""

    max_invalid_frac: float = Field(
        0.5,
        ge=0,
        le=1,
        description="stop the run when more than this share of an "
        "iteration's rewards are invalid (None, NaN, inf)",
    )


class MultiTurnConfig(Section):
    """Multi-turn rollouts: episodes of an environment (components/envs), hermes-style tool calls by default
    (components/rollout/multi_turn.py)."""

    enable: bool = Field(False, description="let the model call tools between turns")
    env: str = Field(
        "tools",
        description="the environment each sample is an episode of (components/envs ENVS): tools = the tools "
        "of multi_turn.tools answer the model's calls; textarena = a game of multi_turn.game; agent = the "
        "agent program of multi_turn.agent drives it through an OpenAI-compatible endpoint; single = one "
        "turn, scored by the row's scorer",
    )
    envs: dict[str, str] = Field(
        {},
        description="a mixture: data_source pattern (fnmatch, e.g. `reasoning_gym/*`) -> the environment its "
        "rows play, the first pattern that matches; rows matching none play multi_turn.env. Figures are "
        "per environment (env/<env>/*, val/<env>/acc)",
    )
    game: str = Field(
        "GuessTheNumber-v0", description="multi_turn.env=textarena: the TextArena game's env id"
    )
    agent: str | None = Field(
        None,
        description="multi_turn.env=agent: the agent program, `file.py:function` inside the project, called "
        "as function(base_url, row, seed) once per episode: it talks to the policy with the openai client at "
        "base_url and returns the episode's reward (None: the row's scorer scores the replies)",
    )
    max_turns: int = Field(
        2, ge=1, description="assistant turns per sample (a call in the last one is not run)"
    )
    tools: list[str] = Field(["calculator"], description="tools offered: calculator, python (sandboxed)")
    max_tool_response_chars: int = Field(
        256, ge=1, description="a tool's output is cut to this many characters"
    )
    step_timeout_s: float = Field(
        60.0,
        gt=0,
        description="an environment's reset or step that takes longer stops the rollout, naming the "
        "environment and the episode",
    )

    @model_validator(mode="after")
    def _known_tools(self) -> MultiTurnConfig:
        keys = {"multi_turn.env": self.env} | {f"multi_turn.envs.{p}": e for p, e in self.envs.items()}
        for key, env in keys.items():
            if env not in ENV_NAMES:
                raise ValueError(f"{key}={env!r}: no such environment; valid: {', '.join(ENV_NAMES)}")
        played = set(keys.values())
        if self.enable and "textarena" in played:
            check_textarena_game(self.game)
        if self.enable and ("agent" in played) != (self.agent is not None):
            raise ValueError(
                "multi_turn.agent names the agent program of the agent environment (multi_turn.env=agent or a "
                "multi_turn.envs value), and only of it: set both "
                f"(multi_turn.env={self.env!r}, multi_turn.envs={self.envs}, multi_turn.agent={self.agent!r})"
            )
        if self.agent is not None and (
            self.agent.count(":") != 1 or not self.agent.split(":")[0].endswith(".py")
        ):
            raise ValueError(
                f"multi_turn.agent={self.agent!r}: give the agent as file.py:function, e.g. "
                "agents/guess.py:play"
            )
        unknown = [t for t in self.tools if t not in TOOL_NAMES]
        if unknown:
            raise ValueError(
                f"multi_turn.tools: unknown tool(s) {unknown}; use some of {', '.join(TOOL_NAMES)}"
            )
        return self


class CustomRewardConfig(Section):
    path: str | None = Field(
        None, description="a Python file inside the project whose function scores every row"
    )
    name: str = Field(
        "compute_score",
        description="the function's name: (response_text, ground_truth, extra_info) -> float or {score, ...}",
    )


class SandboxConfig(Section):
    """Limits of the bubblewrap sandbox that runs model-written code (code reward, python tool), each for the
    whole process tree of a run."""

    timeout_s: float = Field(10.0, gt=0, description="wall-clock limit per run; the process group is killed")
    cpu_s: int = Field(5, ge=1, description="CPU-seconds of a run's whole process tree")
    memory_mb: int = Field(
        512,
        ge=64,
        description="resident memory of a run's whole process tree (and each process's address space)",
    )
    max_processes: int = Field(16, ge=1, description="processes of a run (RLIMIT_NPROC of its own uid)")
    max_open_files: int = Field(64, ge=8, description="open files per process (RLIMIT_NOFILE)")
    max_output_bytes: int = Field(1 << 20, ge=1024, description="stdout/stderr/file size cap (RLIMIT_FSIZE)")
    concurrency: int = Field(2, ge=1, description="sandboxed runs at once")
    allowed_packages: list[str] = Field(
        [],
        description="packages code may import besides the standard library "
        "(mounted read-only from this environment), e.g. [numpy]",
    )

    @model_validator(mode="after")
    def _installed(self) -> SandboxConfig:
        for name in self.allowed_packages:
            if not installed(name):
                raise ValueError(
                    f"sandbox.allowed_packages: {name!r} is not installed in this environment, so it "
                    "cannot be mounted into the sandbox; install it (pip install) or remove it"
                )
        return self


class ImageProcessorConfig(Section):
    size: int = Field(32, ge=8, description="images are resized to this many pixels a side")
    crop: bool = Field(True, description="resize the short side, then center-crop a square; false = squash")


def check_textarena_game(game: str) -> None:
    """ValueError naming multi_turn.game when TextArena has no such game, with the closest ids it has (it has
    hundreds: all of them would not be one line)."""
    import difflib

    from textarena.envs.registration import ENV_REGISTRY

    if game not in ENV_REGISTRY:
        close = difflib.get_close_matches(game, list(ENV_REGISTRY), n=4, cutoff=0.5)
        raise ValueError(
            f"multi_turn.game={game!r}: TextArena has no such game"
            + (f"; the closest: {', '.join(close)}" if close else "")
            + f" ({len(ENV_REGISTRY)} ids in textarena.envs.registration.ENV_REGISTRY)"
        )


def check_reasoning_gym_tasks(tasks: dict[str, dict[str, Any]]) -> None:
    """ValueError (the config's error: it names the key) for an unknown task, listing the valid ones, or a
    setting the task refuses."""
    import reasoning_gym

    if not tasks:
        raise ValueError(
            "data.task=reasoning_gym needs data.reasoning_gym: a mapping of task name to settings, e.g. "
            "data.reasoning_gym='{chain_sum: {max_terms: 2}}'"
        )
    known = sorted(reasoning_gym.factory.DATASETS)
    for name, settings in tasks.items():
        if name not in known:
            raise ValueError(f"{name}: no such reasoning-gym task; valid tasks: {', '.join(known)}")
        try:
            # the first entry too: some settings pass the task's own check and fail only when an entry is made
            # (simple_equations' operators without as many operators_weights)
            reasoning_gym.create_dataset(name, size=1, seed=0, **(settings or {}))[0]
        except Exception as exc:  # noqa: BLE001 - the task's code is not ours; its refusal is the config's error
            raise ValueError(f"{name}: its settings fail: {exc}") from None


class DataConfig(Section):
    train_path: str = Field("data/clean/train.parquet", description="cleaned training parquet")
    eval_path: str = Field("data/clean/test.parquet", description="cleaned held-out parquet")
    raw_dir: str = Field("data/raw", description="where `prepare` writes raw parquet")
    quarantine_dir: str = Field("data/quarantine", description="where rejected rows go, with a reason")
    batch_size: int = Field(32, ge=1, description="prompts per RL iteration")
    shuffle: bool = Field(True, description="shuffle prompts each epoch")
    max_prompt_len: int = Field(16, ge=1, description="prompts longer than this (tokens) are quarantined")
    apply_chat_template: bool | None = Field(
        None,
        description="render prompts through the tokenizer's chat "
        "template; None = yes for chat messages, no for plain strings",
    )
    allow_unk: bool = Field(
        False,
        description="keep prompts with characters outside the tokenizer's vocabulary "
        "(they reach the model as its unknown token); false = quarantine",
    )
    num_train: int = Field(4000, ge=1, description="generated training problems")
    num_eval: int = Field(200, ge=1, description="generated held-out problems")
    max_operand: int = Field(99, ge=1, description="largest operand of a generated problem")
    operations: list[Literal["+", "-", "*"]] = Field(["+"], description="operators used by the generator")
    gsm8k_path: str | None = Field(
        None, description="local GSM8K jsonl/parquet to import instead (its train split)"
    )
    gsm8k_test_path: str | None = Field(
        None, description="local GSM8K test file; None = hold out data.num_eval seeded rows of gsm8k_path"
    )
    task: Literal["arith", "arith_tool", "visual_count", "reasoning_gym", "textarena"] = Field(
        "arith",
        description="generated task; arith_tool: SFT answers that call the calculator (multi_turn); "
        "visual_count: count the shapes in an image (actor.model.type=multimodal); reasoning_gym: the tasks "
        "data.reasoning_gym names; textarena: games of multi_turn.game, data.num_train rows of a "
        "demonstrator's moves (one per turn) for SFT and data.num_eval held-out games",
    )
    reasoning_gym: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="data.task=reasoning_gym: reasoning-gym task name -> its settings (e.g. {chain_sum: "
        "{max_terms: 2}}); data.num_train and data.num_eval are shared out among them, each generated "
        "locally from trainer.seed and scored by the task's own score_answer",
    )
    image_processor: ImageProcessorConfig = Field(
        default_factory=lambda: ImageProcessorConfig(), description="how images become pixels"
    )
    max_count: int = Field(4, ge=1, le=9, description="visual_count: most shapes in an image")
    llava_path: str | None = Field(
        None, description="a local LLaVA jsonl (image, conversations) to import instead of the generator"
    )
    llava_image_folder: str | None = Field(
        None, description="where the LLaVA jsonl's image paths are relative to; None = the jsonl's folder"
    )
    tool_sft_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="arith_tool: share of SFT answers that call the calculator (the rest answer directly)",
    )

    @field_validator("reasoning_gym")
    @classmethod
    def _reasoning_gym_tasks(cls, tasks: dict, info: ValidationInfo) -> dict:
        if info.data.get("task") == "reasoning_gym":
            check_reasoning_gym_tasks(tasks)
        return tasks


class SFTConfig(Section):
    base_model: str | None = Field(
        None, description="local HF model to start from; None = build the tiny model"
    )
    output_dir: str = Field("checkpoints/sft", description="where the SFT model is saved (HF format)")
    steps: int = Field(300, ge=0, description="optimizer steps")
    batch_size: int = Field(64, ge=1, description="examples per step")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    final_lr_frac: float = Field(1.0, gt=0, le=1, description="lr at the last step as a fraction of sft.lr")
    hidden_size: int = Field(128, ge=8, description="tiny model width")
    num_layers: int = Field(2, ge=1, description="tiny model depth")
    num_heads: int = Field(4, ge=1, description="tiny model attention heads")
    intermediate_size: int = Field(512, ge=8, description="tiny model MLP width")
    num_experts: int = Field(
        0, ge=0, description="tiny model: experts per layer (a Qwen2-MoE policy); 0 = a dense Qwen2"
    )
    experts_per_token: int = Field(2, ge=1, description="tiny MoE model: experts each token is routed to")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> SFTConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"sft.num_heads={self.num_heads} must divide sft.hidden_size={self.hidden_size}."
            )
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise ValueError(
                f"sft.experts_per_token={self.experts_per_token} is more than sft.num_experts="
                f"{self.num_experts}: route each token to at most num_experts experts"
            )
        return self


class TrainerConfig(Section):
    iterations: int = Field(60, ge=1, description="RL iterations")
    save_interval: int = Field(20, ge=1, description="checkpoint every N iterations (and at the end)")
    test_interval: int = Field(10, ge=1, description="evaluate every N iterations (and at the end)")
    seed: int = Field(0, description="seed of every RNG")
    save_optimizer: bool = Field(
        True, description="store optimizer state in checkpoints (an exact resume needs it)"
    )
    resume_mode: str = Field(
        "auto",
        description="auto (continue this configuration's run, or extend it to more "
        "iterations), disable (a new run from the start), or a checkpoint "
        "directory",
    )
    resume_accept_mismatch: bool = Field(
        False,
        description="resume_mode=<checkpoint> of another configuration: "
        "continue it anyway (in a new run directory)",
    )
    checkpoint_format: Literal["full", "sharded"] = Field(
        "full",
        description="full: rank 0 gathers the model (HF format) and optimizer; sharded: every worker writes its "
        "own shards at once (torch.distributed.checkpoint, safetensors). Either resumes under any worker "
        "layout; `reinforge convert` turns a sharded checkpoint into a Hugging Face directory",
    )
    when_finished: Literal["stop", "retrain"] = Field(
        "stop",
        description="resume_mode=auto when this configuration's "
        "run already finished trainer.iterations: stop with a message, "
        "or train a new run from the start (the nightly)",
    )
    stage_timeout_s: int = Field(
        1200,
        ge=1,
        description="a worker call running longer is killed with every process "
        "it started, and counts as the worker's death; scoring "
        "rewards longer stops the run",
    )
    connect_timeout_s: float = Field(
        15.0,
        gt=0,
        description="seconds Ray (RAY_ADDRESS), MLflow (MLFLOW_TRACKING_URI) "
        "and Prefect (PREFECT_API_URL) have to answer at start",
    )
    ray_start_timeout_s: float = Field(
        120.0,
        gt=0,
        description="seconds a local Ray instance has to start (its GCS's wait; Ray's raylet waits a fixed 30 "
        "s, so a start that fails is tried once more): a loaded machine takes longer than Ray's defaults",
    )
    max_worker_rebuilds: int = Field(
        3,
        ge=0,
        description="times a dead worker group is rebuilt from the last checkpoint before the run fails",
    )
    max_checkpoints_to_keep: int | None = Field(
        None, ge=1, description="prune all but the newest N (None = keep all)"
    )
    output_dir: str = Field("checkpoints/grpo", description="checkpoints and the final model")
    run_dir: str = Field(
        ".",
        description="every data and output path must resolve inside it ('.' = the working "
        "directory); model paths may point anywhere (read only)",
    )
    backend: Literal["ray", "local"] = Field(
        "ray",
        description="where the workers run: ray (actors of a local Ray instance, or of RAY_ADDRESS's "
        "cluster) or local (every worker in this process, as TRL runs: no Ray to start, one policy worker, "
        "pdb works; a policy or engine call that hangs is not killed, a reward call past "
        "trainer.stage_timeout_s still stops the run)",
    )
    num_workers: int = Field(1, ge=1, description="policy workers (Ray actors, one torch.distributed group)")
    strategy: Literal["ddp", "fsdp", "deepspeed"] = Field(
        "ddp",
        description="how several workers share the update: ddp replicas, fsdp shards (FSDP2), deepspeed ZeRO",
    )
    data_parallel_size: int | None = Field(
        None,
        ge=1,
        description="model replicas; fsdp shards each over "
        "num_workers / this (None: fsdp 1 = full sharding, ddp num_workers)",
    )
    zero_stage: Literal[1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage (trainer.strategy=deepspeed)")
    worker_resources: dict[str, float] = Field(
        {"CPU": 1.0},
        description="Ray resources of each policy worker: CPU, GPU, or a custom name such as NPU",
    )
    rollout_resources: dict[str, float] = Field(
        {},
        description="custom Ray resources of each rollout engine in an actor of its own "
        "(rollout_placement=separate), e.g. {rollout: 1} for the nodes started with `ray start "
        "--resources='{\"rollout\": 4}'`; its CPU and GPU follow engine.type and engine.num_gpus",
    )
    ref_placement: Literal["colocate", "separate"] = Field(
        "colocate", description="reference policy on the policy workers, or in an actor of its own"
    )
    rollout_placement: Literal["auto", "colocate", "separate"] = Field(
        "auto",
        description="rollout engine inside policy worker 0, sampling with its own parameters (no weight "
        "copy), or in an actor of its own; auto = colocate with one worker, engine.type=hf and async_mode=sync",
    )
    async_mode: Literal["sync", "one_step_off", "bounded_staleness"] = Field(
        "sync",
        description="sync: each rollout waits for the update before it; one_step_off: batch k+1 is sampled "
        "(with the weights from before update k) while the policy updates on batch k; bounded_staleness: up "
        "to max_staleness batches sampled ahead, a batch older than that dropped",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="policy versions a sample may lag the policy it trains (bounded_staleness: also the "
        "batches sampled ahead); None = 1. one_step_off: 1",
    )
    partial_rollouts: bool = Field(
        False,
        description="bounded_staleness with the hf or vllm engine: an update's weights reach the engine at "
        "once; a rollout in flight stops its samples after the current decode (vllm: scheduler) step, loads "
        "them, and finishes its samples with them (flagged partial_rollout; async/partial_samples). Where "
        "updates land depends on timing: a run is no longer reproducible bit for bit",
    )
    min_workers: int | None = Field(
        None,
        ge=1,
        description="the fewest policy workers a run may start or rebuild with when the cluster has no room "
        "for trainer.num_workers (the global batch is kept; workers/policy logs the count); unset: exactly "
        "trainer.num_workers, else an error before training",
    )
    grad_compression: Literal["auto", "none", "fp16", "powersgd"] = Field(
        "auto", description="DDP gradient all-reduce: auto picks from the measured bandwidth"
    )
    compression_fp16_below_gbps: float = Field(
        2.0, gt=0, description="auto: fp16 gradients below this all-reduce bandwidth (GB/s)"
    )
    compression_powersgd_below_gbps: float = Field(
        0.2, gt=0, description="auto: PowerSGD below this bandwidth (GB/s)"
    )
    simulated_bandwidth_gbps: float | None = Field(
        None,
        gt=0,
        description="testing: hold the bandwidth measurement "
        "to this rate, as on a slow link (None = measure as is)",
    )
    num_threads: int = Field(
        2,
        ge=1,
        description="torch threads per worker (asynchronous modes: split between the engine and the policy, "
        "which compute at once)",
    )
    experiment_name: str = Field("reinforge", description="MLflow experiment")
    eval_k: int = Field(4, ge=1, description="samples per prompt for mean@k / pass@k")
    eval_size: int | None = Field(None, ge=1, description="held-out prompts evaluated (None = all)")
    progress: bool = Field(True, description="show a progress display")
    log_system_metrics: bool = Field(
        False, description="log CPU, memory, disk, network (and GPU) use to the MLflow run's system metrics"
    )
    system_metrics_interval_s: float = Field(
        10.0, gt=0, description="seconds between two samples of the system metrics"
    )

    @model_validator(mode="after")
    def _one_worker_in_process(self) -> TrainerConfig:
        if self.backend == "local" and self.num_workers > 1:
            raise ValueError(
                f"trainer.backend=local runs one policy worker in this process, not trainer.num_workers="
                f"{self.num_workers}. Set trainer.num_workers=1, or trainer.backend=ray for several workers."
            )
        return self


class MemoryOptimConfig(Section):
    gradient_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations in "
        "backward (Hugging Face gradient checkpointing)",
    )
    activation_checkpointing: bool = Field(
        False, description="the same recomputation, under FSDP's name; either key turns it on"
    )
    param_offload: bool = Field(
        False,
        description="fsdp/deepspeed: keep parameters in host memory between uses "
        "(changes nothing when the workers run on CPU)",
    )
    optimizer_offload: bool = Field(
        False,
        description="fsdp/deepspeed: optimizer state and step in host memory "
        "(changes nothing when the workers run on CPU)",
    )


class MixedPrecisionConfig(Section):
    enabled: bool = Field(False, description="autocast the update")
    dtype: Literal["bf16", "fp16"] = Field(
        "bf16", description="autocast dtype (fsdp: parameter dtype in compute)"
    )
    loss_scale: Literal["dynamic", "none"] = Field(
        "dynamic", description="fp16: scale the loss (GradScaler) so small gradients do not underflow"
    )


class DistillConfig(Section):
    """On-policy distillation (docs/algorithms.md): the policy (the student) samples, a teacher scores every
    sampled token, and the per-token advantage is coef x (log p_teacher - log p_student), the negative
    reverse KL, plus task_coef x the task reward's advantage. On when teacher_path is set (algorithm.name=opd
    is GRPO's knobs with the teacher required)."""

    teacher_path: str | None = Field(
        None,
        description="local Hugging Face model directory of the teacher (its tokenizer must be the student's)",
    )
    coef: float = Field(1.0, ge=0, description="weight of the per-token reverse-KL advantage")
    task_coef: float = Field(
        0.0, ge=0, description="weight of the task reward's advantage (0 = pure distillation)"
    )
    loss: Literal["reverse_kl", "jsd"] = Field(
        "reverse_kl",
        description="reverse_kl: coef x (log p_teacher - log p_student) of each sampled token is its advantage; "
        "jsd: GKD's generalised JSD over the whole vocabulary at each of the student's positions, coef x it "
        "added to the loss (needs the teacher beside the policy)",
    )
    jsd_beta: float = Field(
        0.5, ge=0, le=1, description="jsd: 0 = forward KL(teacher || student), 1 = reverse KL, between: JSD"
    )
    placement: Literal["colocate", "separate"] = Field(
        "colocate",
        description="the teacher beside the policy in each policy worker, or in a Ray actor of its own "
        "(reverse_kl only: jsd reads its whole distributions in the update)",
    )

    @model_validator(mode="after")
    def _jsd_beside_the_policy(self) -> DistillConfig:
        if self.loss == "jsd" and self.placement == "separate":
            raise ValueError(
                "distill.loss=jsd needs the teacher's whole distributions in the update: set "
                "distill.placement=colocate, or use distill.loss=reverse_kl with the teacher in its own actor"
            )
        return self


class Config(Section):
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="RL algorithm")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="policy and its optimizer")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="value model (PPO with gae)")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="rollout engine")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig, description="rewards")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="checks on the rewards")
    custom_reward_function: CustomRewardConfig = Field(
        default_factory=CustomRewardConfig, description="a user's reward function"
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="code sandbox limits")
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig, description="tool-calling rollouts")
    data: DataConfig = Field(default_factory=DataConfig, description="datasets")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="supervised warm start")
    distill: DistillConfig = Field(default_factory=DistillConfig, description="on-policy distillation")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="loop, seeds, outputs")
    memory_optim: MemoryOptimConfig = Field(default_factory=MemoryOptimConfig, description="memory options")
    mixed_precision: MixedPrecisionConfig = Field(
        default_factory=MixedPrecisionConfig, description="precision"
    )

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        from components.config.checks import check_combinations

        check_combinations(self)
        return self
