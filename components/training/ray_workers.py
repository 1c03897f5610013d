"""The Ray actors of a training run, behind typed handles: local Ray by default, the cluster in RAY_ADDRESS.

- PolicyGroup: the policy workers (one torch.distributed group, rank 0 first). Its methods shard or share a
  batch as the update needs, wait for every rank, and answer rank 0's result.
- RolloutGroup: the rollout engines (an EnginePool of actors, or policy worker 0 when colocated): sampling
  with a weights version, pushing weights, health checks.
- RewardGroup: the RewardScorer actor (the reward functions); ReferenceActor, RewardModelActor.

The groups reach their actors through a transport (components/training/transport.py): Ray, or the same worker
objects in this process (components/training/local_workers.py; trainer.backend=local, and fast tests of the
flow).

Every call is bounded by trainer.stage_timeout_s: a call that hangs gets its actors' whole process trees
killed and raises StageTimeout, a transient failure the flow recovers from by rebuilding the group
(docs/architecture.md says where each kind of failure is handled).
"""

from __future__ import annotations

import logging

import ray
import torch

from components.batch import Batch
from components.errors import ReinforgeError, ResourceError, RewardError, StartAbandoned
from components.plan import RunPlan
from components.rewards.scorer import RewardScorer
from components.rollout.pool import FAILURES, EnginePool
from components.rollout.worker import RolloutWorker
from components.settings import (
    Placement,
    PolicySettings,
    ReferenceSettings,
    RewardSettings,
    RolloutSettings,
    SamplingParams,
)
from components.training.cluster import ensure_ray
from components.training.distributed import GroupSpec
from components.training.loop import balanced_shards
from components.training.transport import RAY
from components.training.worker import ColocatedWorker, PolicyWorker, ReferenceWorker

UPDATES = "updates"  # a rollout actor's Ray concurrency group for weight updates (partial rollouts)


class StageTimeout(TimeoutError):
    """A worker call ran past trainer.stage_timeout_s; its process tree was killed (`done` says so)."""

    def __init__(self, message: str, done: str = ""):
        super().__init__(message)
        self.done = done  # what became of the hung call's workers


class Actors:
    """Calls on a set of actors, waited for at most `timeout_s`; a call that hangs past it gets the actors'
    process trees killed and raises StageTimeout naming the role and the call."""

    role = "worker"

    def __init__(self, actors: list, pids: list[int], timeout_s: float, transport=RAY):
        self.actors, self.pids, self.timeout_s = list(actors), list(pids), timeout_s
        self.transport = transport

    def wait(self, refs: list, what: str) -> list:
        try:
            return self.transport.get(refs, self.timeout_s)
        except self.transport.task_error as exc:
            # our own message (a diverged update, a bad reward), not Ray's wrapper around it
            if isinstance(exc.cause, ReinforgeError):
                raise exc.cause from None
            # a collective whose peer died (its node lost) fails on the survivors too, "connection closed by
            # peer", and Ray raises the first failure in the list: the death is the cause, and what the flow
            # rebuilds the group from
            raise self.transport.death_among(refs) or exc from None
        except self.transport.timeout_error:
            done = self.transport.stop_hung(self.pids)
            raise StageTimeout(
                f"{self.role} worker: {what} did not finish within {self.timeout_s:g} s "
                f"(trainer.stage_timeout_s); {done}",
                done,
            ) from None

    def refresh_pids(self) -> None:
        """After Ray restarted an actor, its process is a new one."""
        self.pids = self.transport.pids(self.actors)

    def stop(self) -> None:
        self.transport.kill(self.actors, self.pids)


def _join_prepared(results: list, shards: list[list[int]]) -> tuple[Batch, dict[str, float]]:
    """prepare's (batch, timings) from every worker -> one batch in the original row order, slowest timings."""
    batch = Batch.concat([r[0] for r in results])
    order = torch.tensor([i for s in shards for i in s])
    timings = {k: max(r[1][k] for r in results) for k in results[0][1]}
    return batch.select(torch.argsort(order)), timings


class PolicyGroup(Actors):
    """The policy workers. Every method is called on every rank (they meet in collectives) and answers rank 0's
    result."""

    role = "policy"

    def __init__(self, actors: list, pids: list[int], timeout_s: float, replica_size: int = 1, transport=RAY):
        super().__init__(actors, pids, timeout_s, transport)
        self.replica_size = replica_size  # consecutive ranks that split one replica (tensor x pipeline)

    def _all(self, what: str, call) -> list:
        return self.wait([call(a) for a in self.actors], what)

    def prepare(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Old/reference log-probs and values (verl's old_log_prob/ref/values stages): each data-parallel
        replica computes a token-balanced shard (every TP or pipeline worker of a replica the same one), joined
        back in row order."""
        if len(self.actors) == 1:
            return self._all("prepare", lambda a: a.prepare.remote(batch))[0]
        tp = self.replica_size
        shards = balanced_shards(batch, len(self.actors) // tp)
        parts = (
            [self.transport.put(batch.select(s)) for s in shards]
            if tp > 1
            else [batch.select(s) for s in shards]
        )
        results = self.wait(
            [a.prepare.remote(parts[rank // tp]) for rank, a in enumerate(self.actors)], "prepare"
        )
        return _join_prepared(results[::tp], shards)

    def _whole(self, batch: Batch):
        """The batch once in the object store for several workers (each takes its share of every mini-batch)."""
        return self.transport.put(batch) if len(self.actors) > 1 else batch

    def update(self, batch: Batch) -> dict[str, float]:
        whole = self._whole(batch)
        return self._all("update", lambda a: a.update.remote(whole))[0]

    def update_critic(self, batch: Batch) -> dict[str, float]:
        whole = self._whole(batch)
        return self._all("update_critic", lambda a: a.update_critic.remote(whole))[0]

    def state(self) -> dict:
        return self.wait([self.actors[0].state.remote()], "state")[0]

    def write_checkpoint(self, out: str, with_optimizer: bool) -> None:
        self._all("write_checkpoint", lambda a: a.write_checkpoint.remote(out, with_optimizer))

    def load_checkpoint(self, path: str) -> int:
        return self._all("load_checkpoint", lambda a: a.load_checkpoint.remote(path))[0]

    def save_model(self, out: str, kind: str) -> str:
        return self._all("save_model", lambda a: a.save_model.remote(out, kind))[0]

    def push_weights(self, engines: list, mid_rollout: bool = False) -> int:
        """Rank 0's (gathered) weights into these rollout actors through one object-store copy (never the
        driver, never disk); every policy worker takes part in the gather. Returns the weights version.
        `mid_rollout` (partial rollouts): each engine loads them between two decode steps of the rollout it
        is sampling, in its own concurrency group, instead of after the rollouts queued before them."""
        refs = [a.get_weights.options(num_returns=2).remote() for a in self.actors]
        weights, version = refs[0]
        opts = {"concurrency_group": UPDATES} if mid_rollout else {}
        done = [e.update_weights.options(**opts).remote(weights, version) for e in engines]
        return self.wait(done + [r[1] for r in refs[1:]], "push_weights")[0]

    def share_weights(self) -> int:
        """Colocated: the engine samples with worker 0's own parameters; only the version moves."""
        return self.wait([self.actors[0].share_weights.remote()], "share_weights")[0]


class RolloutGroup(Actors):
    """The rollout engines: the pool's actors, or (colocated) policy worker 0 itself."""

    role = "rollout"

    def __init__(
        self,
        actors: list,
        pids: list[int],
        timeout_s: float,
        pool: EnginePool | None = None,
        health_check: bool = False,
        mid_rollout: bool = False,
        colocated: bool = False,
        transport=RAY,
    ):
        super().__init__(actors, pids, timeout_s, transport)
        self.pool, self.health = pool, health_check
        self.mid_rollout = mid_rollout  # partial rollouts: updates land mid-rollout
        self.colocated = colocated  # the engine is policy worker 0's own module: only versions move

    def engines(self) -> list:
        return self.pool.actors if self.pool is not None else self.actors

    def refresh_pids(self) -> None:
        self.actors = self.engines()
        super().refresh_pids()

    def generate(
        self,
        rows: list[dict],
        params: SamplingParams,
        seed: int,
        iteration: int,
        version: int,
        greedy: bool = False,
        seeds: list[int] | None = None,
    ) -> Batch:
        """params.n samples per row with weights `version` (each engine refuses other weights): on one engine,
        or split across the pool by prompt length (`seeds`, one per engine; a dead engine is restarted and its
        share retried)."""
        if self.pool is None:  # one engine: colocated (the policy's own module), or in this process
            return self.wait(
                [self.actors[0].generate.remote(rows, params, seed, iteration, version, greedy)], "generate"
            )[0]
        from components.data.prompts import prompt_text

        restarts = self.pool.restarts
        batch = self.pool.generate(
            rows,
            [len(prompt_text(r["prompt"])) for r in rows],
            (params, iteration, version, greedy),
            seeds or [seed],
            self.timeout_s,
        )
        if self.pool.restarts != restarts:
            self.refresh_pids()
        return batch

    def versions(self) -> list[int]:
        return self.wait([e.weights_version.remote() for e in self.engines()], "weights_version")

    def stale(self, version: int) -> list:
        """The engines whose weights are not `version` (a restarted one holds the SFT weights). An engine that
        dies on the question (after its health check, before it samples) is restarted by the pool, which hands
        it the current weights, instead of failing the stage."""
        behind = (lambda v: v < version) if self.mid_rollout else (lambda v: v != version)  # newer: landed
        if self.pool is None:
            return [e for e, v in zip(self.engines(), self.versions()) if behind(v)]
        out = []
        for k, engine in enumerate(list(self.pool.actors)):
            try:
                current = ray.get(engine.weights_version.remote(), timeout=self.pool.health_timeout_s)
            except FAILURES:
                self.pool.restart(k)
                continue
            if behind(current):
                out.append(engine)
        return out


class ReferenceActor(Actors):
    role = "reference"

    def logprobs(self, batch: Batch) -> torch.Tensor:
        return self.wait([self.actors[0].logprobs.remote(batch)], "logprobs")[0]


class TeacherActor(ReferenceActor):
    """On-policy distillation's teacher in an actor of its own: its log-probs of the samples."""

    role = "teacher"


class RewardModelActor(Actors):
    role = "reward_model"

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return self.wait([self.actors[0].score.remote(prompts, responses)], "score")[0]


class RewardGroup(Actors):
    """The RewardScorer actor: the reward functions in a process of their own, so a scorer that hangs is killed
    with its whole process tree and one that kills its process is retried on a restarted actor (Ray's
    max_restarts and max_task_retries: same inputs, same rewards)."""

    role = "reward"

    def __init__(self, actors: list, pids: list[int], timeout_s: float, concurrency: int = 2, transport=RAY):
        super().__init__(actors, pids, timeout_s, transport)
        self.concurrency = concurrency  # sandbox.concurrency: sandboxed scorers at once

    def score(
        self, texts: list[str], truths: list, sources: list[str], extras: list[dict], scorers: dict
    ) -> tuple[list[float], list[bool], dict]:
        """(scores, valid, sub-scores) of each response by its row's scorer (`scorers`: data_source -> scorer,
        resolved in the driver, shipped with the call). A scorer that raises fails at once, naming the
        sample; one that runs past trainer.stage_timeout_s stops the run (a retry would hang again)."""
        from components.rewards.registry import scorer_name

        self.refresh_pids()  # Ray restarts a scorer whose process died: a hang kills the one running now
        call = self.actors[0].score.remote(texts, truths, sources, extras, scorers, self.concurrency)
        try:
            return self.wait([call], "score")[0]
        except StageTimeout as exc:
            self.stop()
            names = ", ".join(sorted({scorer_name(f) for f in scorers.values()}))
            raise RewardError(
                f"scoring {len(texts)} responses with {names} did not finish within "
                f"trainer.stage_timeout_s={self.timeout_s:g} s; {exc.done}. Make the reward function faster, or "
                "raise trainer.stage_timeout_s."
            ) from None


class Workers:
    """The actors a training run keeps across iterations."""

    def __init__(
        self,
        policy: PolicyGroup,
        rollout: RolloutGroup,
        rewards: RewardGroup,
        reference: ReferenceActor | None = None,
        reward_model: RewardModelActor | None = None,
        teacher: TeacherActor | None = None,
    ):
        self.policy, self.rollout, self.rewards = policy, rollout, rewards
        self.reference, self.reward_model, self.teacher = reference, reward_model, teacher

    def push_weights(self) -> int:
        """The policy's weights into every engine (colocated: only the version moves); returns the version."""
        if self.rollout.colocated:
            return self.policy.share_weights()
        return self.policy.push_weights(self.rollout.engines(), self.rollout.mid_rollout)

    def sample(
        self,
        rows: list[dict],
        params: SamplingParams,
        seed: int,
        iteration: int,
        version: int,
        greedy: bool = False,
        seeds: list[int] | None = None,
    ) -> Batch:
        """A rollout from engines that are alive (health-checked first when engine.health_check) and hold
        weights `version`; `engine_restarts` in its meta counts the engines restarted on the way."""
        pool = self.rollout.pool
        restarts = pool.restarts if pool is not None else 0
        if pool is not None and self.rollout.health:
            pool.health_check()
        self.ensure_current(version)
        batch = self.rollout.generate(rows, params, seed, iteration, version, greedy, seeds)
        if pool is not None:
            batch.meta["engine_restarts"] = pool.restarts - restarts
        return batch

    def ensure_current(self, version: int) -> list:
        """A rollout actor that Ray restarted after it died comes back with the SFT weights: give it the
        policy's current weights before it samples, so a stale engine is never sampled. Returns the stale ones."""
        if self.rollout.colocated:
            return []
        pool = self.rollout.pool
        restarts = pool.restarts if pool is not None else 0
        stale = self.rollout.stale(version)
        if stale or (pool is not None and pool.restarts != restarts):
            self.rollout.refresh_pids()
        if stale:
            self.policy.push_weights(stale)
        return stale

    def stop(self) -> None:
        extra = [g for g in (self.reference, self.reward_model, self.teacher) if g is not None]
        for group in [self.policy, *([] if self.rollout.colocated else [self.rollout]), self.rewards, *extra]:
            group.stop()


def workers_that_fit(plan: RunPlan) -> int:
    """trainer.num_workers, or, when the cluster has no room for them (too small, or a node lost) and
    trainer.min_workers allows fewer, the largest count that fits and still splits the batch and mini-batches
    evenly. ResourceError below trainer.min_workers (unset: trainer.num_workers)."""
    placement, responses = plan.placement, plan.batch_size * plan.sampling.n
    mini_batch = plan.policy.update.loop.mini_batch_size
    need = {k: v for k, v in placement.worker_resources.items() if v > 0}
    total = ray.cluster_resources()
    # the rollout actors take a CPU between them, a separate reference actor one worker's resources
    fits = min(
        [
            int((total.get(k, 0.0) - (1.0 if k == "CPU" else 0.0)) // v)
            - placement.separate_reference
            - placement.separate_teacher
            for k, v in need.items()
        ]
        or [placement.num_workers]
    )
    mini = mini_batch or responses
    p = plan.policy.parallel
    tp = p.tensor_parallel_size * p.pipeline_parallel_size  # the group shrinks by whole replicas
    n = next(
        (
            k
            for k in range(min(placement.num_workers, fits), 0, -1)
            if k % tp == 0 and responses % (k // tp) == 0 and mini % (k // tp) == 0
        ),
        0,
    )
    if n < placement.min_workers:
        fewer = (
            f"trainer.min_workers={placement.min_workers}"
            if placement.min_workers < placement.num_workers
            else f"trainer.num_workers={placement.num_workers}"
        )
        raise ResourceError(
            f"the Ray cluster has room for {max(fits, 0)} policy worker(s) of {need} "
            f"(trainer.worker_resources), fewer than {fewer}. Add nodes, lower trainer.num_workers, or "
            "set trainer.min_workers to the fewest the run may use."
        )
    return n


def engines_fit(placement: Placement) -> None:
    """ResourceError when no node of the cluster has the custom resources the engines ask for: Ray would
    leave them pending, and the run would wait for them until its stage timeout."""
    total = ray.cluster_resources()
    short = {k: v for k, v in placement.rollout_resources.items() if total.get(k, 0.0) < v}
    if short:
        raise ResourceError(
            f"trainer.rollout_resources={placement.rollout_resources}: the Ray cluster has "
            f"{ {k: total.get(k, 0.0) for k in short} }; start a node that has them (ray start "
            "--resources='{...}'), or change trainer.rollout_resources."
        )


class Started:
    """The actors a start of a run's workers has made so far, recorded as each is made. A start that fails
    partway kills them (a policy group up and an engine that failed must not keep their resources), and
    `abandon()`, from the flow that stopped on a bad input while its workers were starting, kills them at once:
    the start fails at its next wait and starts nothing more, so the run neither waits for the start (~6 s on
    2 cores) nor leaves an actor behind."""

    def __init__(self, transport=RAY):
        self.actors: list = []
        self.abandoned = False
        self.transport = transport  # what reaches (and kills) the actors: Ray's, or this process's

    def record(self, actor):
        """`actor`, now this start's; killed at once when the start was abandoned meanwhile."""
        self.actors.append(actor)  # before the check: abandon() kills what it finds after setting the flag
        if self.abandoned:
            self.transport.kill([actor], [])
            raise StartAbandoned("the run stopped while its workers were starting")
        return actor

    def abandon(self) -> None:
        self.abandoned = True
        self.transport.kill(list(self.actors), [])


def _split_resources(resources: dict) -> tuple[float, float, dict | None]:
    res = dict(resources)
    return res.pop("CPU", 0.0), res.pop("GPU", 0.0), res or None


def start_policy_group(
    settings: PolicySettings,
    placement: Placement,
    n: int,
    colocated: bool,
    timeout_s: float,
    started: Started | None = None,
) -> PolicyGroup:
    """n PolicyWorker actors spread over the cluster, joined into one process group (rank 0's address);
    with `colocated`, rank 0 also serves the rollout engine (ColocatedWorker). The policy workers are not
    restarted by Ray: the flow rebuilds the group from the last checkpoint."""
    num_cpus, num_gpus, res = _split_resources(placement.worker_resources)
    classes = [ColocatedWorker if colocated and rank == 0 else PolicyWorker for rank in range(n)]
    started = started or Started()
    actors = [
        started.record(
            ray.remote(max_restarts=0)(cls)
            .options(num_cpus=num_cpus, num_gpus=num_gpus, resources=res, scheduling_strategy="SPREAD")
            .remote(settings)
        )
        for cls in classes
    ]
    try:
        addr, port = ray.get(actors[0].address.remote())
        backend = "nccl" if num_gpus else "gloo"
        specs = [GroupSpec(rank, n, addr, port, backend) for rank in range(n)]
        pids = ray.get([a.setup.remote(spec) for a, spec in zip(actors, specs)])  # surface start-up errors
    except Exception:
        # one failed (its node lost as it started, or a bad model): the others must not keep their resources
        RAY.kill(actors, [])
        raise
    p = settings.parallel
    return PolicyGroup(actors, pids, timeout_s, p.tensor_parallel_size * p.pipeline_parallel_size)


def policy_group(plan: RunPlan, n: int | None = None) -> PolicyGroup:
    """The plan's policy workers alone (n of them; trainer.num_workers by default), without a rollout engine."""
    ensure_ray()
    p = plan.placement
    return start_policy_group(plan.policy, p, n or p.num_workers, False, p.stage_timeout_s)


def start_engine(settings: RolloutSettings, placement: Placement):
    """One rollout actor (RolloutWorker with the configured engine). Ray restarts it up to 3 times; GPU engines
    reserve engine.num_gpus (default tensor_parallel_size) GPUs, hf engines share one CPU between them."""
    cpus = 1.0 / placement.num_engines if settings.engine_type == "hf" else 1.0
    # partial rollouts: updates run in a thread of their own, so one reaches the engine mid-rollout
    groups = {"concurrency_groups": {UPDATES: 1}} if settings.partial else {}
    actor_class = ray.remote(
        num_cpus=cpus,
        num_gpus=placement.engine_gpus,
        resources=placement.rollout_resources or None,  # a custom resource: the nodes that have it
        max_restarts=3,
        **groups,
    )
    return actor_class(RolloutWorker).remote(
        settings.model_path,
        settings.engine_type,
        settings.options,
        settings.num_threads,
        multi_turn=settings.multi_turn,
        prompts=settings.prompts,
        lora=settings.lora,  # without it, the engine would get adapter tensors for a model that has none
        partial=settings.partial,
    )


def start_workers(plan: RunPlan, started: Started | None = None) -> Workers:
    """The policy group, the rollout engines (colocated in policy worker 0, or actors of their own), the
    separate reference and the reward model, as the plan places them. A start that fails partway (or is
    abandoned: `started`) leaves none of the actors it made."""
    started = started or Started()
    try:
        return _start_workers(plan, started)
    except BaseException:
        RAY.kill(list(started.actors), [])
        if started.abandoned:  # whatever its wait raised once its actors were killed
            raise StartAbandoned("the run stopped while its workers were starting") from None
        raise


def _start_workers(plan: RunPlan, started: Started) -> Workers:
    ensure_ray()
    p, timeout = plan.placement, plan.placement.stage_timeout_s
    n = workers_that_fit(plan)
    if n != p.num_workers:
        logging.getLogger("reinforge").warning(
            "starting %d policy workers instead of trainer.num_workers=%d: the "
            "cluster has no room for more (the global batch is kept)",
            n,
            p.num_workers,
        )
    colocated = p.colocated(n, plan.rollout.engine_type)
    if not colocated:
        engines_fit(p)
    policy = start_policy_group(plan.policy, p, n, colocated, timeout, started)
    if colocated:
        rollout = RolloutGroup(policy.actors[:1], policy.pids[:1], timeout, colocated=True)
    else:
        engines = [started.record(start_engine(plan.rollout, p)) for _ in range(p.num_engines)]
        rollout = RolloutGroup(
            engines,
            ray.get([e.pid.remote() for e in engines]),
            timeout,
            EnginePool(
                engines,
                lambda: start_engine(plan.rollout, p),
                lambda e: policy.push_weights([e]),
                p.health_check_timeout_s,
            ),
            p.health_check,
            mid_rollout=plan.rollout.partial,
        )
    workers = Workers(policy, rollout, start_reward_group(plan.rewards, started))
    if plan.reference is not None:
        workers.reference = _start_reference(plan.reference, p, timeout, started)
    if plan.teacher is not None:
        workers.teacher = _start_reference(plan.teacher, p, timeout, started, TeacherActor)
    if p.reward_model:
        workers.reward_model = _start_reward_model(p, plan.policy.num_threads, timeout, started)
    return workers


def _start_reference(
    settings: ReferenceSettings,
    placement: Placement,
    timeout_s: float,
    started: Started,
    group: type[ReferenceActor] = ReferenceActor,
) -> ReferenceActor:
    num_cpus, num_gpus, res = _split_resources(placement.worker_resources)
    actor = started.record(
        ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, resources=res, max_restarts=3)(
            ReferenceWorker
        ).remote(settings)
    )
    return group([actor], [ray.get(actor.pid.remote())], timeout_s)


def _start_reward_model(
    placement: Placement, num_threads: int, timeout_s: float, started: Started
) -> RewardModelActor:
    from components.models.loading import check_model_dir
    from components.rewards.reward_model import RewardModelScorer

    # a clear error here, not a failed actor start
    check_model_dir(
        placement.reward_model, "reward_model.path", trust_remote_code=placement.trust_remote_code
    )
    actor = started.record(
        ray.remote(num_cpus=0, max_restarts=3)(RewardModelScorer).remote(
            placement.reward_model,
            placement.reward_model_dtype,
            placement.reward_model_batch_size,
            num_threads,
            trust_remote_code=placement.trust_remote_code,
        )
    )
    return RewardModelActor([actor], [ray.get(actor.pid.remote())], timeout_s)


def start_reward_group(settings: RewardSettings, started: Started | None = None) -> RewardGroup:
    """The RewardScorer actor (no CPU of its own: it waits on its scorers, which run in sandboxes or threads).
    A dead process is restarted and the call retried (same inputs, same rewards); an exception is not."""
    ensure_ray()
    actor = (started or Started()).record(
        ray.remote(num_cpus=0, max_restarts=3, max_task_retries=3)(RewardScorer).remote()
    )
    return RewardGroup([actor], [ray.get(actor.pid.remote())], settings.timeout_s, settings.concurrency)
