"""Data-parallel rollout: several engine actors, prompts split across them by load, each checked before a
rollout (a tiny generation within a timeout) and restarted when it fails, with the rollout retried.

Ray restarts a killed actor (its `max_restarts`); one that cannot come back is replaced by a new one. A
restarted engine holds the SFT weights, so `sync` hands it the policy's weights before it samples again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ray

from components.batch import Batch

log = logging.getLogger("reinforge")
FAILURES = (
    ray.exceptions.RayActorError,
    ray.exceptions.GetTimeoutError,
    ray.exceptions.ActorUnavailableError,
)


def split_by_load(lengths: list[int], parts: int) -> list[slice]:
    """Contiguous slices of rows, one per engine, with about equal prompt tokens each (every slice non-empty
    while there are enough rows).

    >>> split_by_load([10, 10, 1, 1, 1, 1], 2)
    [slice(0, 1, None), slice(1, 6, None)]
    >>> split_by_load([5] * 4, 3)
    [slice(0, 1, None), slice(1, 3, None), slice(3, 4, None)]
    """
    parts = max(1, min(parts, len(lengths)))
    total, bounds, acc, start = sum(lengths), [], 0, 0
    for k in range(parts - 1):
        target = total * (k + 1) / parts
        end = start + 1
        acc += lengths[start]
        while end < len(lengths) - (parts - 1 - k) and acc + lengths[end] / 2 <= target:
            acc += lengths[end]
            end += 1
        bounds.append(slice(start, end))
        start = end
    bounds.append(slice(start, len(lengths)))
    return bounds


class EnginePool:
    """The rollout actors of a run. `sync(actor)` gives an actor the policy's current weights."""

    def __init__(
        self,
        actors: list,
        make_actor: Callable[[], object],
        sync: Callable[[object], None],
        health_timeout_s: float = 60.0,
        startup_timeout_s: float = 600.0,
    ):
        self.actors, self.make_actor, self.sync = list(actors), make_actor, sync
        self.health_timeout_s, self.startup_timeout_s = health_timeout_s, startup_timeout_s
        self.restarts = 0
        self.pids: dict[int, int] = {}  # engine -> the pid that last answered

    def _healthy(self, actor, timeout: float) -> int | None:
        """The pid of an engine that answered its health check in time, else None."""
        try:
            return ray.get(actor.health.remote(), timeout=timeout)
        except FAILURES:
            return None

    def restart(self, k: int) -> None:
        """Kill engine k (Ray restarts it), wait until it answers, then hand it the current weights; an actor
        Ray will not restart any more is replaced by a new one."""
        actor = self.actors[k]
        try:
            ray.kill(actor, no_restart=False)
        except ValueError:
            pass
        deadline = time.monotonic() + self.startup_timeout_s
        while (pid := self._healthy(actor, min(self.health_timeout_s, 30.0))) is None:
            if time.monotonic() > deadline or _dead_for_good(actor):
                log.warning("rollout engine %d did not come back; starting a new one", k)
                actor = self.actors[k] = self.make_actor()
                pid = self._healthy(actor, self.startup_timeout_s)
                if pid is None:
                    raise RuntimeError(
                        f"rollout engine {k}: a new actor did not answer within {self.startup_timeout_s:g} s"
                    )
                break
            time.sleep(0.5)
        self._restarted(k, pid)

    def _restarted(self, k: int, pid: int) -> None:
        self.restarts += 1
        self.pids[k] = pid
        self.sync(self.actors[k])

    def health_check(self) -> None:
        """Each engine answers a one-token generation within health_timeout_s, or is restarted. One that Ray
        already restarted on its own (a new pid) counts as a restart too, and gets the current weights."""
        for k, actor in enumerate(self.actors):
            pid = self._healthy(actor, self.health_timeout_s)
            if pid is None:
                log.warning("rollout engine %d failed its health check; restarting it", k)
                self.restart(k)
            elif k in self.pids and pid != self.pids[k]:
                log.warning("rollout engine %d was restarted by Ray; giving it the current weights", k)
                self._restarted(k, pid)
            else:
                self.pids[k] = pid

    def generate(
        self,
        rows: list[dict],
        lengths: list[int],
        args: tuple,
        seeds: list[int],
        timeout_s: float | None = None,
        retries: int = 2,
    ) -> Batch:
        """RolloutWorker.generate(rows_k, params, seeds[k], *args) on each engine's share of the rows; a share
        whose engine dies (or hangs past timeout_s) is retried on the restarted engine. Shares come back
        joined in row order."""
        from components.rollout.batching import concat_rounds

        shares = split_by_load(lengths, len(self.actors))
        params, rest = args[0], args[1:]
        refs = {
            k: self.actors[k].generate.remote(rows[s], params, seeds[k], *rest) for k, s in enumerate(shares)
        }
        parts: dict[int, Batch] = {}
        for k, s in enumerate(shares):
            for attempt in range(retries + 1):
                try:
                    parts[k] = ray.get(refs[k], timeout=timeout_s)
                    break
                except FAILURES as exc:
                    if attempt == retries:
                        raise
                    log.warning(
                        "rollout engine %d failed mid-rollout (%s); restarting it and retrying its %d rows",
                        k,
                        type(exc).__name__,
                        s.stop - s.start,
                    )
                    self.restart(k)
                    refs[k] = self.actors[k].generate.remote(rows[s], params, seeds[k], *rest)
        ordered = [parts[k] for k in range(len(shares))]
        batch = ordered[0] if len(ordered) == 1 else concat_rounds(ordered)
        batch.meta["gen_seconds"] = max(p.meta.get("gen_seconds", 0.0) for p in ordered)
        return batch


def _dead_for_good(actor) -> bool:
    """Ray reports the actor DEAD (no restarts left), not RESTARTING."""
    try:
        from ray.util.state import get_actor

        state = get_actor(actor._actor_id.hex())
        return state is not None and state.state == "DEAD"
    except Exception:  # the state API is best effort; the deadline still applies
        return False
