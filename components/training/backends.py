"""Where a run's workers live (trainer.backend), registered once: Ray actors (a local instance, or RAY_ADDRESS's
cluster), or the same worker objects in the driver's own process (local). Each entry is the start of a run's
workers, with the transport that reaches (and kills) what the start made. Those whose workers are Ray actors
are components/config/names.py's RAY_BACKENDS (Ray's init must run in the main thread, before the start)."""

from __future__ import annotations

from components.algorithms.registry import Registry
from components.config.names import RAY_BACKENDS
from components.plan import RunPlan
from components.training import local_workers, ray_workers
from components.training.cluster import ensure_ray
from components.training.transport import LOCAL, RAY

BACKENDS: Registry = Registry("worker backend", "trainer.backend")
BACKENDS.register("ray", transport=RAY)(ray_workers.start_workers)
BACKENDS.register("local", transport=LOCAL)(local_workers.start_local_workers)


def start_workers(plan: RunPlan, started: ray_workers.Started | None = None) -> ray_workers.Workers:
    """The plan's workers where trainer.backend puts them; `started` records each actor as it is made."""
    return BACKENDS.get(plan.placement.backend)(plan, started)


def starts_ahead(plan: RunPlan) -> bool:
    """Whether the plan's workers start beside the driver's checks (actors: processes of their own) or after
    them (in this process, whose imports would hold the interpreter's lock)."""
    return plan.placement.backend in RAY_BACKENDS


def starting(plan: RunPlan) -> ray_workers.Started:
    """What a start of the plan's workers records them in, its backend made ready (in the main thread)."""
    if plan.placement.backend in RAY_BACKENDS:
        ensure_ray(start_timeout_s=plan.placement.ray_start_timeout_s)
    return ray_workers.Started(BACKENDS.info(plan.placement.backend)["transport"])
