"""A run's workers as objects in this process, behind the same typed groups as the Ray actors.

`start_local_workers(plan)` builds what `start_workers` would place on Ray: one policy worker (with the
rollout engine colocated in it, or an engine of its own in an asynchronous mode), the separate reference, the
reward model and the reward scorer. The groups reach them through the local transport, so the flow's own
functions (`iteration`, `collect`, `recover`) run unchanged, in seconds, with no Ray: what the fast tests of
the flow's logic use (tests/flows/test_flow_logic.py). A run always uses Ray.
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
    Workers,
)
from components.training.transport import LOCAL, LocalActor
from components.training.worker import ColocatedWorker, PolicyWorker, ReferenceWorker


def _group(cls, obj, timeout_s: float, **kwargs):
    actors = [LocalActor(obj)]
    return cls(actors, LOCAL.pids(actors), timeout_s, transport=LOCAL, **kwargs)


def local_policy_group(plan: RunPlan, colocated: bool = False) -> PolicyGroup:
    """One policy worker of the plan (a ColocatedWorker, engine inside, if `colocated`) in this process,
    set up as a group of one: what a one-worker Ray group runs, without its process."""
    worker = (ColocatedWorker if colocated else PolicyWorker)(plan.policy)
    worker.setup(GroupSpec(0, 1, "127.0.0.1", 0, "gloo"))
    return _group(PolicyGroup, worker, plan.placement.stage_timeout_s)


def start_local_workers(plan: RunPlan) -> Workers:
    """The plan's workers in this process: one policy worker whatever trainer.num_workers says (a process holds
    one torch.distributed group of one)."""
    p, timeout = plan.placement, plan.placement.stage_timeout_s
    colocated = p.colocated(1, plan.rollout.engine_type)
    policy = local_policy_group(plan, colocated)
    if colocated:
        rollout = RolloutGroup(policy.actors, policy.pids, timeout, colocated=True, transport=LOCAL)
    else:
        engine = RolloutWorker.from_settings(plan.rollout)
        rollout = _group(RolloutGroup, engine, timeout, mid_rollout=plan.rollout.partial)
    rewards = _group(
        RewardGroup, RewardScorer(), plan.rewards.timeout_s, concurrency=plan.rewards.concurrency
    )
    workers = Workers(policy, rollout, rewards)
    if plan.reference is not None:
        workers.reference = _group(ReferenceActor, ReferenceWorker(plan.reference), timeout)
    if p.reward_model:
        from components.rewards.reward_model import RewardModelScorer

        scorer = RewardModelScorer(
            p.reward_model,
            p.reward_model_dtype,
            p.reward_model_batch_size,
            plan.policy.num_threads,
            trust_remote_code=p.trust_remote_code,
        )
        workers.reward_model = _group(RewardModelActor, scorer, timeout)
    return workers
