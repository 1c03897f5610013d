"""Cross-field checks: combinations that no single field can rule out, each with its fix."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from components.config.names import ADAPTER_ENGINES, INTERRUPTIBLE_ENGINES, LORA_RANKS, installed
from components.errors import ConfigError

if TYPE_CHECKING:
    from components.config.schema import Config


# Paths every command may write: each must resolve (symlinks followed) inside trainer.run_dir. The data files
# (data.raw_dir, data.train_path, data.eval_path) are read from anywhere (your own data) and contained only
# where a stage writes them: prepare and clean (check_contained).
CONTAINED_PATHS = (
    "data.quarantine_dir",
    "sft.output_dir",
    "trainer.output_dir",
)
# Output directories a stage replaces or prunes: never the run directory itself.
OUTPUT_DIRS = ("sft.output_dir", "trainer.output_dir")


def config_value(cfg, dotted: str):
    """The value at a dotted key (`trainer.seed`) of a Config."""
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def path_problems(cfg: Config, keys: tuple[str, ...] = CONTAINED_PATHS) -> list[str]:
    """Each path of `keys` that escapes trainer.run_dir (by `..`, an absolute path or a symlink), with the fix.
    Only resolves names; nothing is created or written."""
    problems = [
        escape_problem(key, config_value(cfg, key), cfg.trainer.run_dir, key in OUTPUT_DIRS) for key in keys
    ]
    return [p for p in problems if p]


def check_contained(cfg: Config, *keys: str) -> None:
    """ConfigError naming each of `keys` (paths a stage is about to write) that escapes trainer.run_dir."""
    if problems := path_problems(cfg, keys):
        raise ConfigError("; ".join(problems))


def escape_problem(key: str, raw: str, run_dir: str, output_dir: bool = False) -> str | None:
    """Why path `raw` (of config key or flag `key`) may not be used: it leaves the run directory (by `..`, an
    absolute path or a symlink), or, for an output directory, it is the run directory itself. None if fine."""
    root = Path(run_dir).resolve()
    resolved = Path(raw).resolve()
    if output_dir and resolved == root:
        return (
            f"{key}={raw}: that is the run directory {root} itself; an output directory is replaced as a "
            f"whole, so give a subdirectory of its own (e.g. {key}={Path(raw) / 'out'})."
        )
    if resolved != root and root not in resolved.parents:
        how = (
            "a symlink leads"
            if Path(raw).resolve() != Path(raw).absolute() and ".." not in Path(raw).parts
            else "it resolves"
        )
        return (
            f"{key}={raw}: {how} outside the run directory {root} (to {resolved}). Keep it inside, or set "
            "trainer.run_dir to a directory that holds it."
        )
    return None


def parallel_problems(cfg: Config, responses: int) -> list[str]:
    """Worker-group settings that cannot work, found before any actor starts."""
    t, problems = cfg.trainer, []
    n, dp = t.num_workers, t.data_parallel_size
    if dp is not None and n % dp:
        problems.append(
            f"trainer.data_parallel_size={dp} must divide trainer.num_workers={n} (each replica is "
            "sharded over num_workers / data_parallel_size workers); change one of them."
        )
    if t.strategy == "ddp" and dp not in (None, n):
        problems.append(
            f"trainer.data_parallel_size={dp}: ddp replicates the model on every worker, so it must "
            f"equal trainer.num_workers={n} (or be unset); use trainer.strategy=fsdp to shard."
        )
    if t.strategy == "deepspeed" and not installed("deepspeed"):
        problems.append(
            "trainer.strategy=deepspeed: package `deepspeed` is not installed. Install it with "
            "`pip install 'reinforge[gpu]'`, or set trainer.strategy=fsdp (ships with torch)."
        )
    if t.strategy == "deepspeed" and t.checkpoint_format == "sharded":
        problems.append(
            "trainer.checkpoint_format=sharded with trainer.strategy=deepspeed: DeepSpeed's engine keeps its own "
            "partitions, which reinforge does not shard into its checkpoints; set "
            "trainer.checkpoint_format=full, or use trainer.strategy=fsdp."
        )
    if t.strategy == "deepspeed" and n > 1 and t.save_optimizer:
        problems.append(
            "trainer.strategy=deepspeed with trainer.save_optimizer=true: reinforge does not gather "
            "ZeRO-partitioned optimizer state into its checkpoints yet, so an exact resume is not "
            "possible. Set trainer.save_optimizer=false (a resume restarts the optimizer state), "
            "or use trainer.strategy=fsdp."
        )
    if cfg.actor.model.attention_implementation == "flash_attention_2" and not installed("flash_attn"):
        problems.append(
            "actor.model.attention_implementation=flash_attention_2: package `flash_attn` is not "
            "installed (it needs a CUDA GPU). Install it with `pip install 'reinforge[gpu]'`, or use "
            "sdpa."
        )
    problems += tensor_parallel_problems(cfg)
    replicas = data_parallel_replicas(cfg)
    mini = cfg.actor.ppo_mini_batch_size or responses
    if replicas > 1 and mini % replicas:
        problems.append(
            f"actor.ppo_mini_batch_size={mini}: each of the {replicas} data-parallel replicas (trainer."
            f"num_workers={n} / (tensor x pipeline parallel)) takes an equal part of a mini-batch, "
            "so it must be a multiple of their number."
        )
    budget = cfg.actor.ppo_max_token_len_per_worker
    if budget is not None and budget < cfg.actor.model.max_seq_len:
        problems.append(
            f"actor.ppo_max_token_len_per_worker={budget} is below actor.model.max_seq_len="
            f"{cfg.actor.model.max_seq_len}, so a long response would not fit a micro-batch; raise it."
        )
    if t.rollout_placement == "colocate" and (n > 1 or cfg.engine.type != "hf"):
        problems.append(
            f"trainer.rollout_placement=colocate shares the policy's parameters with an hf engine in "
            f"one worker, but trainer.num_workers={n}, engine.type={cfg.engine.type}; set "
            "trainer.rollout_placement=separate (or auto)."
        )
    if t.min_workers is not None and t.min_workers > n:
        problems.append(f"trainer.min_workers={t.min_workers} is above trainer.num_workers={n}; lower it.")
    return problems


def tensor_parallel_problems(cfg: Config) -> list[str]:
    """A tensor-parallel mesh that cannot be built: TP not dividing the workers, data parallelism across
    TP replicas by anything but FSDP, and models the architecture's plan cannot split."""
    t, tp = cfg.trainer, cfg.actor.tensor_model_parallel_size
    if tp == 1:
        return []
    n, problems = t.num_workers, []
    pp = cfg.actor.pipeline_model_parallel_size
    if n % (tp * pp):
        return []  # mesh_problems names it
    if n // tp > 1 and t.strategy != "fsdp" and pp == 1:
        problems.append(
            f"trainer.strategy={t.strategy} with actor.tensor_model_parallel_size={tp} and {n // tp} "
            "data-parallel replicas: only FSDP shards tensor-parallel (DTensor) parameters across replicas; "
            "set trainer.strategy=fsdp."
        )
    if t.data_parallel_size is not None:
        problems.append(
            f"trainer.data_parallel_size={t.data_parallel_size} with actor.tensor_model_parallel_size={tp}: "
            "the data-parallel size is trainer.num_workers / tensor_model_parallel_size; unset it."
        )
    return problems


def lora_config_problems(cfg: Config) -> list[str]:
    """What LoRA cannot be combined with in this version, a quantized base without a GPU, an engine that
    takes no adapters, and adapters the model cannot take (components/models/lora.py)."""
    lora = cfg.actor.lora
    if lora.rank == 0:
        if lora.quantization != "none":
            return [
                f"actor.lora.quantization={lora.quantization} quantizes the frozen base under LoRA adapters, but "
                "actor.lora.rank=0 trains the whole model; set actor.lora.rank (16 is common) or quantization=none."
            ]
        return []
    problems = []
    if lora.quantization != "none":
        import torch

        why = (
            "no CUDA GPU is visible"
            if not torch.cuda.is_available()
            else "package `bitsandbytes` is not installed (pip install 'reinforge[gpu]')"
            if not installed("bitsandbytes")
            else None
        )
        if why:
            problems.append(
                f"actor.lora.quantization={lora.quantization}: a quantized base (QLoRA) needs bitsandbytes on a "
                f"CUDA GPU, and {why}; set actor.lora.quantization=none on this machine."
            )
    if cfg.engine.type not in ADAPTER_ENGINES and not cfg.engine.lora_merge_on_sync:
        problems.append(
            f"actor.lora.rank={lora.rank} with engine.type={cfg.engine.type}: this version sends adapters alone "
            f"only to the {', '.join(ADAPTER_ENGINES)} engines; set engine.lora_merge_on_sync=true (merged "
            "full weights after each update)."
        )
    if cfg.engine.type == "vllm" and not cfg.engine.lora_merge_on_sync and lora.rank > LORA_RANKS[-1]:
        problems.append(
            f"actor.lora.rank={lora.rank}: vLLM takes adapters of rank {LORA_RANKS[-1]} at most; lower it, or "
            "set engine.lora_merge_on_sync=true."
        )
    return problems + lora_limits(cfg, "actor.lora", lora.rank)


def lora_limits(cfg: Config, key: str, rank: int) -> list[str]:
    """What adapters (the actor's or the critic's, `key`) cannot be combined with in this version."""
    t = cfg.trainer
    unsupported = {
        "actor.tensor_model_parallel_size > 1": cfg.actor.tensor_model_parallel_size > 1,
        "actor.pipeline_model_parallel_size > 1": cfg.actor.pipeline_model_parallel_size > 1,
        "trainer.strategy=deepspeed": t.strategy == "deepspeed",
        # the adapter and merged weights are read off rank 0's whole copy (DDP); FSDP shards it
        "trainer.strategy=fsdp over several workers": t.strategy == "fsdp" and t.num_workers > 1,
        "trainer.checkpoint_format=sharded": t.checkpoint_format == "sharded",
        "actor.model.type=multimodal": cfg.actor.model.type == "multimodal",
    }
    return [
        f"{key}.rank={rank} with {what} is not supported in this version; set one of them back."
        for what, present in unsupported.items()
        if present
    ]


def critic_lora_problems(cfg: Config) -> list[str]:
    """The critic's adapters: the same limits as the actor's (its backbone is trained by the same workers),
    and adapters its backbone can take."""
    lora = cfg.critic.lora
    if lora.rank == 0:
        return []
    problems = []
    if lora.quantization != "none":
        problems.append(
            f"critic.lora.quantization={lora.quantization}: a quantized critic backbone is not supported in "
            "this version; set critic.lora.quantization=none."
        )
    return problems + lora_limits(cfg, "critic.lora", lora.rank)


def async_problems(cfg: Config) -> list[str]:
    """Asynchronous modes need an engine with weights of its own, awake while the policy updates."""
    t, mode = cfg.trainer, cfg.trainer.async_mode
    if t.partial_rollouts:
        if mode != "bounded_staleness" or t.max_staleness == 0:
            why = (
                "nothing is sampled ahead, so no rollout is in flight during an update"
                if mode != "one_step_off"
                else "one_step_off samples exactly one version behind, which a mid-rollout update would break"
            )
            return [
                f"trainer.partial_rollouts=true with trainer.async_mode={mode}"
                + (" and trainer.max_staleness=0" if mode == "bounded_staleness" else "")
                + f": {why}; use trainer.async_mode=bounded_staleness with trainer.max_staleness >= 1, or "
                "unset trainer.partial_rollouts."
            ]
        what = {
            f"engine.type={cfg.engine.type}": cfg.engine.type not in INTERRUPTIBLE_ENGINES,
            "multi_turn.enable=true": cfg.multi_turn.enable,
            "actor.model.type=multimodal": cfg.actor.model.type == "multimodal",
        }
        if bad := [k for k, on in what.items() if on]:
            return [
                f"trainer.partial_rollouts=true with {bad[0]}: in this version only single-turn text samples "
                f"of the engines {', '.join(INTERRUPTIBLE_ENGINES)} stop mid-way for an update; unset "
                "trainer.partial_rollouts (updates then wait for the rollouts in flight)."
            ]
    if mode == "sync":
        return []
    key, problems = f"trainer.async_mode={mode}", []
    if mode == "one_step_off" and t.max_staleness not in (None, 1):
        problems.append(
            f"{key} samples exactly one policy version behind, but trainer.max_staleness={t.max_staleness}; "
            "unset it, or use trainer.async_mode=bounded_staleness."
        )
    if t.rollout_placement == "colocate":
        problems.append(
            f"{key} with trainer.rollout_placement=colocate: a colocated engine samples with the policy's own "
            "parameters, which the update is changing; set trainer.rollout_placement=separate (or auto)."
        )
    if cfg.engine.sleep_during_update:
        problems.append(
            f"{key} with engine.sleep_during_update=true: the engine samples during the update; set "
            "engine.sleep_during_update=false (or trainer.async_mode=sync to share the GPU)."
        )
    return problems


def data_parallel_replicas(cfg: Config) -> int:
    """The model's replicas: workers / (tensor x pipeline parallel); the workers themselves when that does
    not divide (mesh_problems refuses it)."""
    n, split = (
        cfg.trainer.num_workers,
        cfg.actor.tensor_model_parallel_size * cfg.actor.pipeline_model_parallel_size,
    )
    return n // split if n % split == 0 else n


def mesh_problems(cfg: Config) -> list[str]:
    """A model-parallel mesh the workers cannot fill: trainer.num_workers = data parallel x pipeline stages x
    tensor parallel."""
    tp, pp, n = (
        cfg.actor.tensor_model_parallel_size,
        cfg.actor.pipeline_model_parallel_size,
        cfg.trainer.num_workers,
    )
    if n % (tp * pp) == 0:
        return []
    keys = [f"actor.tensor_model_parallel_size={tp}"] * (tp > 1) + [
        f"actor.pipeline_model_parallel_size={pp}"
    ] * (pp > 1)
    return [
        f"{' x '.join(keys)} must divide trainer.num_workers={n} (workers = data parallel x pipeline x tensor "
        f"parallel); set trainer.num_workers to a multiple of {tp * pp}."
    ]


def pipeline_problems(cfg: Config) -> list[str]:
    """What this version's pipeline parallelism cannot do yet, and a pipeline deeper than the model."""
    pp, t = cfg.actor.pipeline_model_parallel_size, cfg.trainer
    if pp == 1:
        return []
    key = f"actor.pipeline_model_parallel_size={pp}"
    problems = []
    replicas = data_parallel_replicas(cfg)
    if replicas > 1 and t.strategy != "ddp":
        problems.append(
            f"trainer.strategy={t.strategy} with {key} and {replicas} pipelines: the pipelines are data-parallel "
            "replicas of the stages (gradients all-reduced, as DDP); set trainer.strategy=ddp."
        )
    if t.data_parallel_size is not None:
        problems.append(
            f"trainer.data_parallel_size={t.data_parallel_size} with {key}: the data-parallel size is "
            "trainer.num_workers / (pipeline x tensor parallel); unset it."
        )
    unsupported = {
        # the stages pass whole activations between them; sequence parallelism splits them inside a stage
        "actor.sequence_parallel=true": cfg.actor.sequence_parallel,
        "trainer.checkpoint_format=sharded": t.checkpoint_format == "sharded",
        "mixed_precision.enabled": cfg.mixed_precision.enabled,
        "actor.model.type=multimodal": cfg.actor.model.type == "multimodal",
    }
    for what, present in unsupported.items():
        if present:
            problems.append(f"{key} with {what} is not supported in this version; set one of them back.")
    return problems


def local_backend_problems(cfg: Config) -> list[str]:
    """What trainer.backend=local (every worker in this process) has no room for: several engines, and the
    health checks that restart an engine's actor."""
    if cfg.trainer.backend != "local":
        return []
    problems = []
    if cfg.engine.num_engines > 1:
        problems.append(
            f"trainer.backend=local runs one rollout engine in this process, not engine.num_engines="
            f"{cfg.engine.num_engines}. Set engine.num_engines=1, or trainer.backend=ray for several engines."
        )
    if cfg.engine.health_check:
        problems.append(
            "engine.health_check=true restarts an engine actor that stops answering; trainer.backend=local "
            "has none (the engine runs in this process). Set engine.health_check=false, or trainer.backend=ray."
        )
    return problems


def check_combinations(cfg: Config) -> None:
    """Raise one ConfigError listing every impossible combination of sections in `cfg` (the rules that need
    the resolved algorithm, the engine's package or the model directories are components/validate.py's)."""
    problems: list[str] = path_problems(cfg)
    problems += mesh_problems(cfg) + pipeline_problems(cfg)
    problems += async_problems(cfg) + lora_config_problems(cfg) + critic_lora_problems(cfg)
    if cfg.trainer.rollout_placement == "colocate" and (
        cfg.engine.type != "hf" or cfg.engine.num_engines > 1
    ):
        problems.append(
            f"trainer.rollout_placement=colocate samples with the policy's own module: one hf engine "
            f"(engine.type={cfg.engine.type}, engine.num_engines={cfg.engine.num_engines}). Use "
            "trainer.rollout_placement=separate; to share a GPU with the policy set engine.num_gpus to "
            "a fraction and engine.sleep_during_update=true."
        )
    problems += local_backend_problems(cfg)
    responses = cfg.data.batch_size * cfg.engine.n
    replicas = data_parallel_replicas(cfg)
    if responses % replicas:
        problems.append(
            f"trainer.num_workers={cfg.trainer.num_workers}: data.batch_size x engine.n = {responses} "
            f"responses must split evenly across the {replicas} data-parallel replicas; change one of them."
        )
    problems += parallel_problems(cfg, responses)
    mini = cfg.actor.ppo_mini_batch_size
    if mini is not None and responses % mini:
        problems.append(
            f"actor.ppo_mini_batch_size={mini} must divide data.batch_size x engine.n = {responses}."
        )
    micro = cfg.actor.ppo_micro_batch_size
    if micro is not None and (mini or responses) % micro:
        problems.append(
            f"actor.ppo_micro_batch_size={micro} must divide the mini-batch ({mini or responses})."
        )
    mt = cfg.multi_turn
    if (
        mt.enable
        and cfg.data.max_prompt_len + mt.max_turns * cfg.engine.max_new_tokens > cfg.actor.model.max_seq_len
    ):
        problems.append(
            f"actor.model.max_seq_len={cfg.actor.model.max_seq_len} is shorter than data.max_prompt_len "
            f"+ multi_turn.max_turns x engine.max_new_tokens = "
            f"{cfg.data.max_prompt_len + mt.max_turns * cfg.engine.max_new_tokens} (tool turns come on "
            "top); raise it or shorten those."
        )
    if cfg.data.max_prompt_len + cfg.engine.max_new_tokens > cfg.actor.model.max_seq_len:
        problems.append(
            f"actor.model.max_seq_len={cfg.actor.model.max_seq_len} is shorter than "
            f"data.max_prompt_len + engine.max_new_tokens = "
            f"{cfg.data.max_prompt_len + cfg.engine.max_new_tokens}; raise it or shorten those."
        )
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
