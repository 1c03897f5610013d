"""Progress display (rich): a bar per phase and one concise line per RL iteration; the iteration's stage timings
and the process's start-up phases (timing_s/*)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)


@contextmanager
def progress_bar(description: str, total: int, enabled: bool = True):
    """Yields advance(**fields); a rich bar with elapsed time when enabled, a no-op otherwise."""
    if not enabled:
        yield lambda **_: None
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        transient=False,
    ) as bar:
        tid = bar.add_task(description, total=total, info="")

        def advance(info: str = "", **_):
            bar.update(tid, advance=1, info=info)

        yield advance


def iteration_line(it: int, total: int, metrics: dict[str, float]) -> str:
    """`iter 12/60  reward 0.41  acc 0.55  3.2s` — accuracy only when evaluated this iteration."""
    parts = [f"iter {it}/{total}", f"reward {metrics.get('critic/score/mean', float('nan')):.3f}"]
    if "val/acc" in metrics:
        parts.append(f"acc {metrics['val/acc']:.3f}")
    parts.append(f"{metrics.get('timing_s/step', 0.0):.2f}s")
    return "  ".join(parts)


class Timer:
    """timing_s/<stage> of one iteration (stages that repeat add up)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[f"timing_s/{name}"] = self.seconds.get(f"timing_s/{name}", 0.0) + seconds

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """The block's seconds, added to timing_s/<name>."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def metrics(self) -> dict[str, float]:
        """The stages' seconds and timing_s/step, the iteration's whole so far."""
        return {"timing_s/step": time.perf_counter() - self.start, **self.seconds}


# a process's start-up, between consecutive marks (wall-clock instants, time.time()) from its start
STARTUP_PHASES = ("imports", "prefect", "setup", "workers")


def startup_metrics(marks: dict[str, float]) -> dict[str, float]:
    """The process's start-up phases in seconds: imports (interpreter and modules; `reinforge` starts Prefect's
    server meanwhile), prefect (the config's checks, the server if not up yet, the flow run), setup (Ray's
    init, then the inputs, the data and the MLflow run while the workers start), workers (what is left of
    their start, and the checkpoint), and first_gen: the process's start to its first rollout."""
    instants = [marks["process"], *(marks[p] for p in STARTUP_PHASES)]
    out = {f"timing_s/startup/{p}": b - a for p, a, b in zip(STARTUP_PHASES, instants, instants[1:])}
    return out | {"timing_s/startup/first_gen": marks["first_gen"] - marks["process"]}


def resume_hint(checkpoint: str | None) -> str:
    """What a stopped run's user does next."""
    if checkpoint:
        return f"The last checkpoint is {checkpoint}: run the same command to resume from it."
    return "No checkpoint was saved yet: run the same command to start again."
