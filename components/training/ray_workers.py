"""Starting the Ray actors: local Ray by default, the cluster in RAY_ADDRESS when set."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import ray

from components.config import Config
from components.rollout.worker import RolloutWorker
from components.training.worker import PolicyWorker

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def ensure_ray() -> None:
    """ray.init() once: RAY_ADDRESS's cluster (shipping our code to it) or a local instance."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}}
    if address:
        runtime_env["py_modules"] = [str(PROJECT_ROOT / "components")]
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, runtime_env=runtime_env,
                 log_to_driver=True, configure_logging=False)


@dataclass
class Workers:
    """Handles of the actors a training run keeps across iterations."""

    policy: "ray.actor.ActorHandle"
    rollout: "ray.actor.ActorHandle"


def start_workers(cfg: Config) -> Workers:
    ensure_ray()
    m = cfg.actor.model
    policy = ray.remote(num_cpus=1, max_restarts=0)(PolicyWorker).remote(cfg.model_dump())
    # the rollout actor is stateless but for its weights (pushed again after a restart); the policy actor is
    # not restarted by Ray: the flow rebuilds it from the last checkpoint
    rollout = ray.remote(num_cpus=1, max_restarts=3)(RolloutWorker).remote(
        m.path, cfg.engine.type, m.dtype, m.attention_implementation, cfg.trainer.num_threads)
    ray.get([policy.state.remote(), rollout.weights_version.remote()])  # surface start-up errors here
    return Workers(policy, rollout)


def stop_workers(workers: Workers) -> None:
    for actor in (workers.policy, workers.rollout):
        try:
            ray.kill(actor, no_restart=True)
        except ValueError:  # not an actor handle any more: nothing to kill
            pass


def rebuild_workers(workers: Workers, cfg: Config) -> Workers:
    """Kill what is left of a worker group and start a fresh one (the caller restores its state)."""
    stop_workers(workers)
    return start_workers(cfg)
