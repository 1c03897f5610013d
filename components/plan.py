"""The run plan: everything a training run decides from its Config, decided once, in the driver.

`make_plan(cfg)` resolves the algorithm preset (the only place that does) and builds each worker's settings
(components/settings.py, each by its own `from_config`) and the loop's schedule. Each worker receives its own
slice (PolicySettings, RolloutSettings, ReferenceSettings) and nothing downstream reads the Config again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from components.algorithms.presets import ResolvedAlgorithm, resolve
from components.config.loader import flatten
from components.config.schema import Config
from components.settings import (
    DistillSettings,
    EvalSettings,
    Placement,
    PolicySettings,
    ReferenceSettings,
    RewardSettings,
    RolloutSettings,
    SamplingParams,
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
    distill: DistillSettings | None = None  # on-policy distillation's advantages (a teacher is set)
    teacher: ReferenceSettings | None = None  # distill.placement=separate: the teacher's own actor


def make_plan(cfg: Config) -> RunPlan:
    """Resolve everything a training run needs from its validated config, once."""
    algo = resolve(cfg.algorithm)
    a, t = cfg.algorithm, cfg.trainer
    return RunPlan(
        algorithm=algo,
        sampling=SamplingParams.from_config(cfg),
        policy=PolicySettings.from_config(cfg, algo),
        rollout=RolloutSettings.from_config(cfg),
        reference=ReferenceSettings.from_config(cfg, algo),
        distill=DistillSettings.from_config(cfg),
        teacher=ReferenceSettings.teacher(cfg),
        placement=Placement.from_config(cfg, algo),
        rewards=RewardSettings.from_config(cfg, algo),
        evaluation=EvalSettings.from_config(cfg),
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
    params = flatten(cfg)
    for key, value in asdict(algo).items():
        if params.get(f"algorithm.{key}") is None:
            params[f"algorithm.{key}"] = value
    return params
