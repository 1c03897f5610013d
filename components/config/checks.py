"""Cross-field checks: combinations that no single field can rule out, each with its fix."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from components.errors import ConfigError

if TYPE_CHECKING:
    from components.config.schema import Config

# engine.type -> (python module, install command); the hf engine ships with the core install.
ENGINE_PACKAGES = {
    "vllm": ("vllm", "pip install 'reinforge[gpu]'  (vllm, needs a CUDA GPU)"),
    "sglang": ("sglang", "pip install 'reinforge[gpu]'  (sglang, needs a CUDA GPU)"),
    "trtllm": ("tensorrt_llm", "pip install tensorrt-llm  (needs a CUDA GPU)"),
}


# Paths the pipeline reads as data or writes to: each must resolve (symlinks followed) inside trainer.run_dir.
CONTAINED_PATHS = ("data.train_path", "data.eval_path", "data.raw_dir", "data.quarantine_dir", "sft.output_dir",
                   "trainer.output_dir")


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def path_problems(cfg: "Config") -> list[str]:
    """Each contained path that escapes trainer.run_dir (by `..`, an absolute path or a symlink), with the fix.
    Only resolves names; nothing is created or written."""
    root = Path(cfg.trainer.run_dir).resolve()
    problems = []
    for key in CONTAINED_PATHS:
        raw = _get(cfg, key)
        resolved = Path(raw).resolve()
        if resolved != root and root not in resolved.parents:
            how = "a symlink leads" if Path(raw).resolve() != Path(raw).absolute() and ".." not in Path(raw).parts \
                else "it resolves"
            problems.append(f"{key}={raw}: {how} outside the run directory {root} (to {resolved}). Keep it "
                            "inside, or set trainer.run_dir to a directory that holds it.")
    return problems


def check_combinations(cfg: "Config") -> None:
    """Raise one ConfigError listing every impossible combination in `cfg`."""
    from components.algorithms import presets

    problems: list[str] = path_problems(cfg)
    algo = None
    try:
        algo = presets.resolve(cfg.algorithm)
    except KeyError as exc:
        problems.append(str(exc.args[0]))
    if cfg.engine.type in ENGINE_PACKAGES:
        module, install = ENGINE_PACKAGES[cfg.engine.type]
        if importlib.util.find_spec(module) is None:
            problems.append(f"engine.type={cfg.engine.type}: package `{module}` is not installed. "
                            f"Install it with `{install}`, or set engine.type=hf.")
    if algo is not None and (algo.grouped or algo.dynamic_sampling) and cfg.engine.n < 2:
        what = algo.adv_estimator if algo.grouped else "dynamic sampling"
        problems.append(f"engine.n={cfg.engine.n}: {what} compares completions of one prompt, "
                        "so it needs engine.n >= 2.")
    responses = cfg.data.batch_size * cfg.engine.n
    if responses % cfg.trainer.num_workers:
        problems.append(f"trainer.num_workers={cfg.trainer.num_workers}: data.batch_size x engine.n = {responses} "
                        "responses must split evenly across workers; change one of them.")
    mini = cfg.actor.ppo_mini_batch_size
    if mini is not None and responses % mini:
        problems.append(f"actor.ppo_mini_batch_size={mini} must divide data.batch_size x engine.n = {responses}.")
    micro = cfg.actor.ppo_micro_batch_size
    if micro is not None and (mini or responses) % micro:
        problems.append(f"actor.ppo_micro_batch_size={micro} must divide the mini-batch ({mini or responses}).")
    if cfg.data.max_prompt_len + cfg.engine.max_new_tokens > cfg.actor.model.max_seq_len:
        problems.append(f"actor.model.max_seq_len={cfg.actor.model.max_seq_len} is shorter than "
                        f"data.max_prompt_len + engine.max_new_tokens = "
                        f"{cfg.data.max_prompt_len + cfg.engine.max_new_tokens}; raise it or shorten those.")
    if cfg.sft.hidden_size % cfg.sft.num_heads:
        problems.append(f"sft.num_heads={cfg.sft.num_heads} must divide sft.hidden_size={cfg.sft.hidden_size}.")
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
