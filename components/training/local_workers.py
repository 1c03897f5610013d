"""A run's workers as objects in this process, behind the same typed groups as the Ray actors.

`start_local_workers(plan)` builds what `start_workers` would place on Ray: one policy worker (with the
rollout engine colocated in it, or an engine of its own in an asynchronous mode), the separate reference, the
reward model and the reward scorer. The groups reach them through the local transport, so the flow's own
functions (`iteration`, `collect`, `recover`) run unchanged with no Ray: a run's workers with
trainer.backend=local (as TRL runs: nothing to start, pdb works), and what the fast tests of the flow's logic
use (tests/flows/test_flow_logic.py).

What Ray's actors give and this process cannot: several policy workers or engines (the config checks refuse
them), and a hung call's processes killed. The reward scorer's calls run in a thread of their own, so a reward
function that hangs still stops the run at trainer.stage_timeout_s; a policy or engine call runs to its end.
"""

from __future__ import annotations

from components.plan import RunPlan
from components.rewards.scorer import RewardScorer
from components.rollout.worker import RolloutWorker
from components.training.distributed import GroupSpec
from components.training.ray_workers import (
    PolicyGroup,
    ReferenceActor,
    RewardGroup,
    RewardModelActor,
    RolloutGroup,
    Started,
    TeacherActor,
    Workers,
)
from components.training.transport import LOCAL, LocalActor, ThreadedActor
from components.training.worker import ColocatedWorker, PolicyWorker, ReferenceWorker


def _group(cls, obj, timeout_s: float, started: Started, actor=LocalActor, **kwargs):
    actors = [started.record(actor(obj))]
    return cls(actors, LOCAL.pids(actors), timeout_s, transport=LOCAL, **kwargs)


def local_policy_group(plan: RunPlan, colocated: bool = False, started: Started | None = None) -> PolicyGroup:
    """One policy worker of the plan (a ColocatedWorker, engine inside, if `colocated`) in this process,
    set up as a group of one: what a one-worker Ray group runs, without its process."""
    worker = (ColocatedWorker if colocated else PolicyWorker)(plan.policy)
    worker.setup(GroupSpec(0, 1, "127.0.0.1", 0, "gloo"))
    return _group(PolicyGroup, worker, plan.placement.stage_timeout_s, started or Started(LOCAL))


def start_local_workers(plan: RunPlan, started: Started | None = None) -> Workers:
    """The plan's workers in this process: one policy worker (a process holds one torch.distributed group
    of one). `started` records each as it is made: a start the flow abandoned builds nothing more."""
    started = started or Started(LOCAL)
    p, timeout = plan.placement, plan.placement.stage_timeout_s
    colocated = p.colocated(1, plan.rollout.engine_type)
    policy = local_policy_group(plan, colocated, started)
    if colocated:
        rollout = RolloutGroup(policy.actors, policy.pids, timeout, colocated=True, transport=LOCAL)
    else:
        engine = RolloutWorker.from_settings(plan.rollout)
        rollout = _group(RolloutGroup, engine, timeout, started, mid_rollout=plan.rollout.partial)
    rewards = _group(
        RewardGroup,
        RewardScorer(),
        plan.rewards.timeout_s,
        started,
        actor=ThreadedActor,
        concurrency=plan.rewards.concurrency,
    )
    workers = Workers(policy, rollout, rewards)
    if plan.reference is not None:
        workers.reference = _group(ReferenceActor, ReferenceWorker(plan.reference), timeout, started)
    if plan.teacher is not None:
        workers.teacher = _group(TeacherActor, ReferenceWorker(plan.teacher), timeout, started)
    if p.reward_model:
        from components.rewards.reward_model import RewardModelScorer

        scorer = RewardModelScorer(
            p.reward_model,
            p.reward_model_dtype,
            p.reward_model_batch_size,
            plan.policy.num_threads,
            trust_remote_code=p.trust_remote_code,
        )
        workers.reward_model = _group(RewardModelActor, scorer, timeout, started)
    return workers
