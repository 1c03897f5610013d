"""Rollouts sampled ahead of the update (trainer.async_mode), as a queue of futures.

The flow submits the generation and scoring of the next iterations before this iteration's update runs, so
the engine samples with the weights it holds (from before the update) while the policy trains. The queue
keeps those futures in iteration order, hands each iteration its own, says when their generation ran (its
overlap with the update), and turns the ones still held into checkpoint files: their weights are not the
checkpoint's, so a resume must train on exactly them rather than sample them again.

It takes whatever futures it is given (a Prefect task's, or concurrent.futures'), so it runs without Prefect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from components.batch import Batch

AHEAD_DIR = "ahead"  # a checkpoint's rollouts sampled ahead: ahead/iter_NNNNNN.batch


def _done(future) -> bool:
    """A Prefect future wraps a concurrent.futures one; either answers done()."""
    return getattr(future, "wrapped_future", future).done()


@dataclass
class Ahead:
    """One rollout sampled ahead: its iteration and its gen and reward futures, or (restored from a
    checkpoint, or taken) its scored batch and reward metrics."""

    iteration: int
    gen: object = None  # future of a Batch whose meta["gen_window"] is (start, end), perf_counter seconds
    reward: object = None  # future of (Batch, reward metrics)
    scored: tuple | None = None
    submitted: float = 0.0  # time.perf_counter() when its generation was submitted

    def result(self) -> tuple:
        if self.scored is None:
            self.scored = self.reward.result()
        return self.scored

    def gen_window(self) -> tuple[float, float] | None:
        """When its generation ran (waiting for it to end): None for one restored from a checkpoint."""
        if self.gen is None:
            return None
        return tuple(self.gen.result().meta["gen_window"])

    def window_so_far(self, now: float) -> tuple[float, float] | None:
        """When its generation ran, without waiting: still running, from its submission to `now` (the engine
        samples the rollouts queued on it back to back, so their union is its busy time either way)."""
        if self.gen is None:
            return None
        return self.gen_window() if _done(self.gen) else (self.submitted, now)

    def to_bytes(self) -> bytes:
        batch, metrics = self.result()
        return Batch(batch.tensors, batch.non_tensors, {**batch.meta, "reward_metrics": metrics}).to_bytes()

    @staticmethod
    def from_bytes(iteration: int, data: bytes) -> Ahead:
        batch = Batch.from_bytes(data)
        return Ahead(iteration, scored=(batch, batch.meta.pop("reward_metrics")))


# it -> (gen future, reward future): submits iteration it's rollout, drawing its rows now
Submit = Callable[[int], tuple[object, object]]


class AheadQueue:
    """The rollouts sampled ahead, in iteration order: at most `depth` past the one the policy trains on, never
    past iteration `last`."""

    def __init__(self, depth: int, last: int):
        self.depth, self.last = depth, last
        self.items: list[Ahead] = []

    def fill(self, start: int, submit: Submit, now: Callable[[], float]) -> None:
        """Submit the iterations from `start` to `depth` past it that are not queued yet, in order (so rows
        are drawn in the order the synchronous loop draws them)."""
        have = {a.iteration for a in self.items}
        for it in range(start, min(start + self.depth, self.last) + 1):
            if it not in have:
                gen, reward = submit(it)
                self.items.append(Ahead(it, gen, reward, submitted=now()))

    def take(self, it: int) -> Ahead:
        """Iteration it's rollout, out of the queue."""
        mine = next(a for a in self.items if a.iteration == it)
        self.items.remove(mine)
        return mine

    def windows(self, now: float, wait: bool) -> list[tuple[float, float]]:
        """When the queued rollouts' generation ran: waiting for each to end (`wait`), or as far as it got."""
        spans = [a.gen_window() if wait else a.window_so_far(now) for a in self.items]
        return [w for w in spans if w is not None]

    def clear(self) -> None:
        self.items = []

    def files(self) -> dict[str, bytes]:
        """The queued rollouts as checkpoint files (waiting for them to be scored)."""
        return {f"{AHEAD_DIR}/iter_{a.iteration:06d}.batch": a.to_bytes() for a in self.items}

    def restore(self, checkpoint: Path) -> None:
        """The checkpoint's rollouts sampled ahead (none in the synchronous loop) replace the queue."""
        self.items = [
            Ahead.from_bytes(int(p.stem.removeprefix("iter_")), p.read_bytes())
            for p in sorted((checkpoint / AHEAD_DIR).glob("iter_*.batch"))
        ]
