"""Starting the Ray actors: local Ray by default, the cluster in RAY_ADDRESS when set."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

from components.batch import Batch
from components.config import Config
from components.data.prompts import PromptSettings
from components.rollout.completions import EngineOptions
from components.rollout.multi_turn import MultiTurnSettings
from components.rollout.pool import EnginePool
from components.rollout.worker import RolloutWorker
from components.shutdown import reclaim_signals
from components.training.distributed import GroupSpec
from components.training.loop import balanced_shards
from components.algorithms.presets import resolve
from components.training.worker import ColocatedWorker, PolicyWorker, ReferenceWorker

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
        # logical CPUs beyond the cores, so a few policy workers and the rollout worker fit on a small machine
        # (each runs trainer.num_threads threads); "local": a new instance even when `ray start` left its address;
        # no idle workers started ahead, not even the two for the first driver (each is a Python process of
        # ~80 MB that a run never uses)
        ray.init(address="local", num_cpus=max(8, os.cpu_count() or 2), include_dashboard=False, runtime_env=runtime_env,
                 log_to_driver=True, configure_logging=False,
                 _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                                 "worker_niceness": 0})
    reclaim_signals()


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


def _concat_prepared(results: list, shards: list[list[int]]):
    """prepare's (batch, timings) from every worker -> one batch in the original row order, slowest timings."""
    batch = Batch.concat([r[0] for r in results])
    order = torch.tensor([i for s in shards for i in s])
    timings = {k: max(r[1][k] for r in results) for k in results[0][1]}
    return batch.select(torch.argsort(order)), timings


# policy methods whose first argument is a batch each worker computes its token-balanced shard of
SHARDED = {"prepare": _concat_prepared}
# ... and those that get the whole batch (stored once in the object store) and take their share of each
# mini-batch themselves, so that N workers step exactly as one
WHOLE = {"update", "update_critic"}


@dataclass
class Workers:
    """Handles of the actors a training run keeps across iterations, their pids and the stage timeout:
    the policy workers (one process group, rank 0 first) and the rollout worker."""

    policy: list
    rollout: "ray.actor.ActorHandle"
    timeout_s: float = 1200.0
    pids: dict[str, list[int]] = field(default_factory=dict)
    reference: "ray.actor.ActorHandle | None" = None  # trainer.ref_placement=separate
    colocated: bool = False  # the rollout engine is policy worker 0 (trainer.rollout_placement)
    reward_model: "ray.actor.ActorHandle | None" = None  # reward_model.path: a RewardModelScorer actor
    pool: "EnginePool | None" = None  # all rollout actors (engine.num_engines); pool.actors[0] is `rollout`

    def _get(self, role: str, method: str, refs: list):
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            pids = self.pids.get(role, [])
            for pid in pids:
                kill_tree(pid)
            raise StageTimeout(f"{role} worker: {method} did not finish within {self.timeout_s:g} s "
                               f"(trainer.stage_timeout_s); its processes (pids {pids}) and every process they "
                               "started were killed") from None

    def call(self, role: str, method: str, *args, **kwargs):
        """`role`.`method`(*args) on its actor(s), waited for at most timeout_s. A call that hangs past it gets
        its actors' whole process trees killed (Ray restarts a rollout actor; the flow rebuilds dead policy
        workers from the last checkpoint) and raises StageTimeout, so nothing is left running behind it.
        Policy calls go to every worker: prepare's batch is split into token-balanced shards (and the results
        joined in row order); update and update_critic get the whole batch through one object-store copy; the
        answer is rank 0's."""
        if role != "policy":  # the rollout or reference actor
            return self._get(role, method, [getattr(getattr(self, role), method).remote(*args, **kwargs)])[0]
        if method in SHARDED and len(self.policy) > 1:
            shards = balanced_shards(args[0], len(self.policy))
            refs = [getattr(a, method).remote(args[0].select(s), *args[1:], **kwargs)
                    for a, s in zip(self.policy, shards)]
            return SHARDED[method](self._get(role, method, refs), shards)
        if method in WHOLE and len(self.policy) > 1:
            args = (ray.put(args[0]), *args[1:])
        return self._get(role, method, [getattr(a, method).remote(*args, **kwargs) for a in self.policy])[0]

    def push_weights(self) -> int:
        """Rank 0's (gathered) weights into the rollout engine straight through the object store (never the
        driver, never disk); every policy worker takes part in the gather. Returns the weights version. A
        colocated engine samples with the policy's own parameters: only the version moves."""
        if self.colocated:
            return self._get("policy", "share_weights", [self.policy[0].share_weights.remote()])[0]
        return self.push_weights_to(self.engines())

    def push_weights_to(self, engines: list) -> int:
        """The policy's weights into these rollout actors (one object-store copy shared by all of them)."""
        refs = [a.get_weights.options(num_returns=2).remote() for a in self.policy]
        weights, version = refs[0]
        done = [e.update_weights.remote(weights, version) for e in engines]
        return self._get("policy", "get_weights", done + [r[1] for r in refs[1:]])[0]

    def stale_engines(self, version: int) -> list:
        """The rollout actors whose weights are not `version` (a restarted one holds the SFT weights)."""
        engines = self.engines()
        versions = self._get("rollout", "weights_version", [e.weights_version.remote() for e in engines])
        return [e for e, v in zip(engines, versions) if v != version]

    def engines(self) -> list:
        """Every rollout actor: the pool's, or the one `rollout` (colocated: policy worker 0)."""
        return self.pool.actors if self.pool is not None else [self.rollout]

    def refresh_pid(self, role: str) -> None:
        """After Ray restarted an actor, its process is a new one."""
        if role == "rollout" and self.pool is not None:
            self.rollout = self.pool.actors[0]
        self.pids[role] = ray.get([e.pid.remote() for e in self.engines()]) if role == "rollout" else \
            ray.get([a.pid.remote() for a in self.policy])


def workers_that_fit(cfg: Config) -> int:
    """trainer.num_workers, or fewer when the cluster no longer has the resources for them (a node lost):
    the largest count that fits and still splits the batch and mini-batches evenly. Error below
    trainer.min_workers."""
    t = cfg.trainer
    need = {k: v for k, v in t.worker_resources.items() if v > 0}
    total = ray.cluster_resources()
    # the rollout actors take a CPU between them, a separate reference actor one worker's resources
    separate_ref = resolve(cfg.algorithm).needs_reference and t.ref_placement == "separate"
    fits = min([int((total.get(k, 0.0) - (1.0 if k == "CPU" else 0.0)) // v) - separate_ref
                for k, v in need.items()] or [t.num_workers])
    responses = cfg.data.batch_size * cfg.engine.n
    mini = cfg.actor.ppo_mini_batch_size or responses
    n = next((k for k in range(min(t.num_workers, fits), 0, -1) if responses % k == 0 and mini % k == 0), 0)
    if n < t.min_workers:
        raise RuntimeError(f"the Ray cluster has room for {max(fits, 0)} policy workers of {need} "
                           f"(trainer.worker_resources), fewer than trainer.min_workers={t.min_workers}. Add nodes, "
                           "or lower trainer.num_workers / trainer.min_workers.")
    return n


def colocate_rollout(cfg: Config, n: int) -> bool:
    """trainer.rollout_placement resolved for n policy workers: auto colocates one worker with an hf engine."""
    placement = cfg.trainer.rollout_placement
    return placement == "colocate" or (placement == "auto" and n == 1 and cfg.engine.type == "hf"
                                       and cfg.engine.num_engines == 1)


def start_policy_group(cfg: Config, n: int, colocated: bool = False) -> tuple[list, list[int]]:
    """n PolicyWorker actors spread over the cluster, joined into one process group (rank 0's address);
    with `colocated`, rank 0 also serves the rollout engine (ColocatedWorker)."""
    res = dict(cfg.trainer.worker_resources)
    num_cpus, num_gpus = res.pop("CPU", 0.0), res.pop("GPU", 0.0)
    classes = [ColocatedWorker if colocated and rank == 0 else PolicyWorker for rank in range(n)]
    actors = [ray.remote(max_restarts=0)(cls).options(num_cpus=num_cpus, num_gpus=num_gpus, resources=res or None,
                                                      scheduling_strategy="SPREAD").remote(cfg.model_dump())
              for cls in classes]
    addr, port = ray.get(actors[0].address.remote())
    backend = "nccl" if num_gpus else "gloo"
    specs = [GroupSpec(rank, n, addr, port, backend) for rank in range(n)]
    pids = ray.get([a.setup.remote(spec) for a, spec in zip(actors, specs)])  # surface start-up errors here
    return actors, pids


def start_workers(cfg: Config) -> Workers:
    ensure_ray()
    n = workers_that_fit(cfg)
    if n != cfg.trainer.num_workers:
        import logging

        logging.getLogger("reinforge").warning("starting %d policy workers instead of trainer.num_workers=%d: the "
                                               "cluster has no room for more (the global batch is kept)", n,
                                               cfg.trainer.num_workers)
    # the policy workers are not restarted by Ray: the flow rebuilds the group from the last checkpoint; the
    # rollout actor is stateless but for its weights (pushed again after a restart)
    colocated = colocate_rollout(cfg, n)
    policy, policy_pids = start_policy_group(cfg, n, colocated)
    if colocated:
        rollout, pids = policy[0], {"policy": policy_pids, "rollout": policy_pids[:1]}
    else:
        engines = [start_engine(cfg) for _ in range(cfg.engine.num_engines)]
        rollout, pids = engines[0], {"policy": policy_pids, "rollout": ray.get([e.pid.remote() for e in engines])}
    reference = None
    if resolve(cfg.algorithm).needs_reference and cfg.trainer.ref_placement == "separate":
        res = dict(cfg.trainer.worker_resources)
        reference = ray.remote(num_cpus=res.pop("CPU", 0.0), num_gpus=res.pop("GPU", 0.0), resources=res or None,
                               max_restarts=3)(ReferenceWorker).remote(cfg.model_dump())
        pids["reference"] = [ray.get(reference.pid.remote())]
    reward_model = None
    if cfg.reward_model.path:
        from components.models.loading import check_model_dir
        from components.rewards.reward_model import RewardModelScorer

        rm = cfg.reward_model
        check_model_dir(rm.path, "reward_model.path")  # a clear error here, not an actor that fails to start
        reward_model = ray.remote(num_cpus=0, max_restarts=3)(RewardModelScorer).remote(
            rm.path, rm.dtype, rm.batch_size, cfg.trainer.num_threads)
        pids["reward_model"] = [ray.get(reward_model.pid.remote())]
    workers = Workers(policy, rollout, float(cfg.trainer.stage_timeout_s), pids, reference, colocated, reward_model)
    if not colocated:
        workers.pool = EnginePool(engines, lambda: start_engine(cfg), lambda e: workers.push_weights_to([e]),
                                  cfg.engine.health_check_timeout_s)
    return workers


def start_engine(cfg: Config):
    """One rollout actor (RolloutWorker with the configured engine). Ray restarts it up to 3 times; GPU engines
    reserve engine.num_gpus (default tensor_parallel_size) GPUs, hf engines share one CPU between them."""
    e = cfg.engine
    gpus = e.num_gpus if e.num_gpus is not None else (0 if e.type == "hf" else e.tensor_parallel_size)
    cpus = 1.0 / e.num_engines if e.type == "hf" else 1.0
    return ray.remote(num_cpus=cpus, num_gpus=gpus, max_restarts=3)(RolloutWorker).remote(
        cfg.actor.model.path, e.type, EngineOptions.from_config(cfg), cfg.trainer.num_threads,
        multi_turn=MultiTurnSettings.from_config(cfg), prompts=PromptSettings.from_config(cfg))


def stop_workers(workers: Workers) -> None:
    rollout = [] if workers.colocated else workers.engines()
    extra = [a for a in (workers.reference, workers.reward_model) if a is not None]
    for actor in [*workers.policy, *rollout, *extra]:
        try:
            ray.kill(actor, no_restart=True)
        except ValueError:  # not an actor handle any more: nothing to kill
            pass


def rebuild_workers(workers: Workers, cfg: Config) -> Workers:
    """Kill what is left of a worker group and start a fresh one, with fewer workers if resources are gone
    (the caller restores its state from the last checkpoint)."""
    stop_workers(workers)
    return start_workers(cfg)


class RewardScorer:
    """Scores rewards in a process of its own (a Ray actor), so a scorer that hangs can be killed with its
    whole process tree and one that kills its process is retried on a restarted actor."""

    def pid(self) -> int:
        return os.getpid()

    def score(self, texts, truths, sources, extras, reward_cfg, scorers):
        from components.rewards.registry import score_batch

        return score_batch(texts, truths, sources, extras, reward_cfg, scorers)


_scorer: dict = {}  # the RewardScorer actor of this driver's Ray session (job id -> handle)


def _scorer_actor():
    job = ray.get_runtime_context().get_job_id()
    if job not in _scorer:
        _scorer.clear()
        # a dead process is restarted and the call retried (same inputs, same rewards); an exception is not
        _scorer[job] = ray.remote(num_cpus=0, max_restarts=3, max_task_retries=3)(RewardScorer).remote()
    return _scorer[job]


def score_in_worker(texts, truths, sources, extras, reward_cfg):
    """score_batch in the RewardScorer actor, bounded by trainer.stage_timeout_s: a scorer that kills its process
    (a segfault, the OOM killer) is retried in a new one with the same inputs, so with the same result; a
    scorer that raises fails at once, naming the sample; one that runs past the timeout has its process tree
    killed and stops the run (RewardError: a retry would hang again). The scorers are resolved here and shipped
    with the call."""
    from components.errors import ReinforgeError, RewardError
    from components.rewards.registry import scorer_name, scorers_for

    ensure_ray()
    scorers = scorers_for(sources, reward_cfg)
    actor = _scorer_actor()
    pid = ray.get(actor.pid.remote())
    timeout = reward_cfg.trainer.stage_timeout_s
    ref = actor.score.remote(texts, truths, sources, extras, reward_cfg, scorers)
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        kill_tree(pid)
        ray.kill(actor, no_restart=True)
        _scorer.clear()
        names = ", ".join(sorted({scorer_name(f) for f in scorers.values()}))
        raise RewardError(f"scoring {len(texts)} responses with {names} did not finish within "
                          f"trainer.stage_timeout_s={timeout:g} s; the scorer's process and every process it started "
                          "were killed. Make the reward function faster, or raise trainer.stage_timeout_s.") from None
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ReinforgeError):  # our message, not Ray's wrapper around it
            raise exc.cause from None
        raise
