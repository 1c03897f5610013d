"""Progress display (rich): a bar per phase and one concise line per RL iteration."""

from __future__ import annotations

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
