"""Starting the Ray actors: local Ray by default, the cluster in RAY_ADDRESS when set."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
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


class StageTimeout(TimeoutError):
    """A worker call ran past trainer.stage_timeout_s; its process tree was killed."""


def kill_tree(pid: int | None) -> None:
    """SIGKILL a process and every process it started (children first), and reap them."""
    import psutil

    if pid is None or not psutil.pid_exists(pid):
        return
    root = psutil.Process(pid)
    procs = root.children(recursive=True) + [root]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


@dataclass
class Workers:
    """Handles of the actors a training run keeps across iterations, their pids and the stage timeout."""

    policy: "ray.actor.ActorHandle"
    rollout: "ray.actor.ActorHandle"
    timeout_s: float = 1200.0
    pids: dict[str, int] = field(default_factory=dict)

    def call(self, role: str, method: str, *args, **kwargs):
        """`role`.`method`(*args) on its actor, waited for at most timeout_s. A call that hangs past it gets its
        actor's whole process tree killed (Ray restarts a rollout actor; the flow rebuilds a dead policy actor
        from the last checkpoint) and raises StageTimeout, so nothing is left running behind it."""
        ref = getattr(getattr(self, role), method).remote(*args, **kwargs)
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            pid = self.pids.get(role)
            kill_tree(pid)
            raise StageTimeout(f"{role} worker: {method} did not finish within {self.timeout_s:g} s "
                               f"(trainer.stage_timeout_s); its process (pid {pid}) and every process it started "
                               "were killed") from None

    def refresh_pid(self, role: str) -> None:
        """After Ray restarted an actor, its process is a new one."""
        self.pids[role] = ray.get(getattr(self, role).pid.remote())


def start_workers(cfg: Config) -> Workers:
    ensure_ray()
    m = cfg.actor.model
    policy = ray.remote(num_cpus=1, max_restarts=0)(PolicyWorker).remote(cfg.model_dump())
    # the rollout actor is stateless but for its weights (pushed again after a restart); the policy actor is
    # not restarted by Ray: the flow rebuilds it from the last checkpoint
    rollout = ray.remote(num_cpus=1, max_restarts=3)(RolloutWorker).remote(
        m.path, cfg.engine.type, m.dtype, m.attention_implementation, cfg.trainer.num_threads)
    pids = ray.get([policy.pid.remote(), rollout.pid.remote()])  # surface start-up errors here
    return Workers(policy, rollout, float(cfg.trainer.stage_timeout_s), {"policy": pids[0], "rollout": pids[1]})


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


@ray.remote(num_cpus=0, max_retries=3, retry_exceptions=False)
def _score_task(texts, truths, sources, extras, reward_cfg, scorers):
    from components.rewards.registry import score_batch

    return score_batch(texts, truths, sources, extras, reward_cfg, scorers)


def score_in_worker(texts, truths, sources, extras, reward_cfg) -> tuple[list[float], list[bool]]:
    """score_batch in a Ray task: a scorer that kills its process (a segfault, the OOM killer) is retried in a
    new one with the same inputs, so with the same result; a scorer that raises fails at once, naming the
    sample (Ray does not retry exceptions). The scorers are resolved here and shipped with the task."""
    from components.rewards.registry import scorers_for

    ensure_ray()
    return ray.get(_score_task.remote(texts, truths, sources, extras, reward_cfg, scorers_for(sources, reward_cfg)))
