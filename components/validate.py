"""The config's rules that need more than the config: the algorithm preset resolved, the engine's package and
GPU, and the model directories (a tensor-parallel plan, LoRA targets, a vision encoder).

`load_checked` is what every command and flow loads its config with: the config layer's own validation
(components/config: fields, sections, and the rules across sections), then these. The config layer imports
no other layer; this module is where the layers meet.
"""

from __future__ import annotations

import json
from pathlib import Path

from components.config import Config, load_config
from components.errors import ConfigError


def load_checked(path: str | None, overrides: list[str] | None = None) -> Config:
    """The validated config; one ConfigError listing every problem these rules find."""
    cfg = load_config(path, overrides or [])
    problems = (
        algorithm_problems(cfg)
        + engine_and_model_problems(cfg)
        + game_data_problems(cfg)
        + router_replay_problems(cfg)
        + distill_problems(cfg)
    )
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
    return cfg


def algorithm_problems(cfg: Config) -> list[str]:
    """What the resolved preset cannot do with these settings (an unknown preset name among them)."""
    from components.algorithms.presets import resolve

    try:
        algo = resolve(cfg.algorithm)
    except KeyError as exc:
        return [str(exc.args[0])]
    problems = []
    greedy = cfg.engine.temperature == 0 or cfg.engine.top_k == 1
    if algo.grouped and cfg.engine.n > 1 and greedy:
        what = "engine.temperature=0" if cfg.engine.temperature == 0 else "engine.top_k=1"
        problems.append(
            f"{what} samples greedily: the engine.n={cfg.engine.n} completions of a prompt are identical, so "
            f"{algo.adv_estimator}'s group advantages are all 0 and nothing would be learned. Sample (e.g. "
            "engine.temperature=1.0, engine.top_k=0), or use a preset without groups (ppo)."
        )
    if (algo.grouped or algo.dynamic_sampling) and cfg.engine.n < 2:
        what = algo.adv_estimator if algo.grouped else "dynamic sampling"
        problems.append(
            f"engine.n={cfg.engine.n}: {what} compares completions of one prompt, so it needs engine.n >= 2."
        )
    if cfg.multi_turn.enable and algo.needs_baseline:
        problems.append(
            f"multi_turn.enable=true with algorithm.name={cfg.algorithm.name}: its greedy baseline is "
            "decoded in one turn, not with tools; use grpo, rloo or another estimator without it."
        )
    pp = cfg.actor.pipeline_model_parallel_size
    if pp > 1 and algo.needs_critic:
        problems.append(
            f"actor.pipeline_model_parallel_size={pp} with a critic (adv_estimator gae) is not supported in "
            "this version; set one of them back."
        )
    return problems


def engine_and_model_problems(cfg: Config) -> list[str]:
    """The engine's package and GPU, and what the model directories cannot take."""
    from components.models.multimodal import vision_problems
    from components.rollout.completions import engine_problems

    problems = engine_problems(cfg.engine.type)
    pp = cfg.actor.pipeline_model_parallel_size
    config = Path(cfg.actor.model.path) / "config.json"
    layers = json.loads(config.read_text()).get("num_hidden_layers") if pp > 1 and config.is_file() else None
    if layers is not None and pp > layers:
        problems.append(
            f"actor.pipeline_model_parallel_size={pp} is more than the {layers} decoder layers of "
            f"actor.model.path={cfg.actor.model.path}; use at most {layers} stages."
        )
    tp, sp = cfg.actor.tensor_model_parallel_size, cfg.actor.sequence_parallel
    if tp > 1 and cfg.trainer.num_workers % (tp * cfg.actor.pipeline_model_parallel_size) == 0:
        from components.training.tensor_parallel import plan_problems  # torch: only for a TP config

        problems += plan_problems(cfg.actor.model.path, tp, sequence_parallel=sp)
        if cfg.critic.model_path:
            problems += plan_problems(cfg.critic.model_path, tp, "critic.model_path", sp)
    if cfg.actor.lora.rank or cfg.critic.lora.rank:
        from components.models.lora import lora_problems
        from components.settings import LoraSettings

        if cfg.actor.lora.rank:
            problems += lora_problems(cfg.actor.model.path, LoraSettings.from_config(cfg.actor.lora))
        if cfg.critic.lora.rank:
            backbone = cfg.critic.model_path or cfg.actor.model.path
            problems += lora_problems(backbone, LoraSettings.from_config(cfg.critic.lora), "critic.lora")
    return problems + vision_problems(cfg)


def game_data_problems(cfg: Config) -> list[str]:
    """data.task=textarena makes a game's rows: the game needs a demonstrator, and the rows need the game to
    play them (multi_turn.enable with the textarena environment)."""
    if cfg.data.task != "textarena":
        return []
    from components.data.games import SOURCE_PREFIX, check_game
    from components.settings import MultiTurnSettings

    problems = []
    try:
        check_game(cfg.multi_turn.game)
    except ValueError as exc:
        problems.append(str(exc))
    mt = cfg.multi_turn
    if not mt.enable or MultiTurnSettings.from_config(cfg).env_of(SOURCE_PREFIX + mt.game) != "textarena":
        problems.append(
            "data.task=textarena makes rows of a game, played by the textarena environment: set "
            "multi_turn.enable=true and multi_turn.env=textarena"
        )
    return problems


# config.json keys that count a mixture-of-experts model's routed experts (Qwen-MoE, Mixtral, DeepSeek)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def router_replay_problems(cfg: Config) -> list[str]:
    """actor.router_replay=R3 replays the routes the hf engine records in one-turn rollouts, into a policy
    that has routers, trained on data-parallel workers (components/models/moe.py)."""
    if cfg.actor.router_replay == "disabled":
        return []
    fix = "or set actor.router_replay=disabled"
    problems = []
    if cfg.engine.type != "hf":
        problems.append(
            f"actor.router_replay=R3: engine.type={cfg.engine.type} does not record the experts each token "
            f"took; use engine.type=hf {fix}"
        )
    unsupported = {
        "multi_turn.enable=true": cfg.multi_turn.enable,
        "trainer.partial_rollouts=true": cfg.trainer.partial_rollouts,
        "actor.tensor_model_parallel_size > 1": cfg.actor.tensor_model_parallel_size > 1,
        "actor.pipeline_model_parallel_size > 1": cfg.actor.pipeline_model_parallel_size > 1,
    }
    problems += [
        f"actor.router_replay=R3 is not supported with {what} (routes are recorded for one-turn rollouts "
        f"sampled whole, and replayed on data-parallel workers); turn it off {fix}"
        for what, on in unsupported.items()
        if on
    ]
    config = Path(cfg.actor.model.path) / "config.json"
    if config.is_file():
        fields = json.loads(config.read_text())
        if not any(fields.get(k) for k in EXPERT_COUNT_KEYS):
            problems.append(
                f"actor.router_replay=R3: actor.model.path={cfg.actor.model.path} is a dense model (no "
                f"experts in its config.json); train a mixture-of-experts policy (sft.num_experts > 0) {fix}"
            )
    return problems


def distill_problems(cfg: Config) -> list[str]:
    """A preset that distils needs a teacher; a teacher must share the student's tokenizer (checked here when
    both directories exist, else when the policy worker loads them)."""
    from components.algorithms.presets import PRESETS_NEEDING_A_TEACHER

    d = cfg.distill
    if d.teacher_path is None:
        if cfg.algorithm.name in PRESETS_NEEDING_A_TEACHER:
            return [
                f"algorithm.name={cfg.algorithm.name} distils from a teacher: set distill.teacher_path to a "
                "local model directory with the student's tokenizer"
            ]
        return []
    student, teacher = Path(cfg.actor.model.path), Path(d.teacher_path)
    if not (student / "config.json").is_file() or not (teacher / "config.json").is_file():
        return []
    from components.errors import ReinforgeError
    from components.models.loading import teacher_tokenizer_problem

    try:
        problem = teacher_tokenizer_problem(student, teacher, cfg.actor.model.trust_remote_code)
    except ReinforgeError as exc:
        return [str(exc)]
    return [problem] if problem else []
