"""What the benchmarks sample in a background thread while a block runs: peak resident memory (here) and the
start-up's CPU time (bench/startup.py), on one sampling loop."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psutil


class BackgroundSampler:
    """Calls `sample()` every `interval_s` in a thread while the `with` block runs."""

    interval_s: float

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class PeakSampler(BackgroundSampler):
    """Element-wise peak of `measure()` (a list of byte counts) sampled every `interval_s` while the `with`
    block runs; `start` holds the first sample. A process that ends between two samples skips that sample."""

    def __init__(self, measure: Callable[[], list[int]], interval_s: float):
        self.measure, self.interval_s = measure, interval_s
        self.start = list(measure())
        self.peak = list(self.start)

    def sample(self) -> None:
        try:
            values = self.measure()
        except psutil.Error:
            return
        self.peak = [max(p, v) for p, v in zip(self.peak, values)]


def rss_of(pids: list[int]) -> Callable[[], list[int]]:
    """The RSS of each of these processes."""
    procs = [psutil.Process(p) for p in pids]
    return lambda: [p.memory_info().rss for p in procs]


def _or_zero(read: Callable, field: str) -> int:
    try:
        return getattr(read(), field)
    except psutil.Error:  # ended since the listing
        return 0


def pss_of_tree(pid: int | None = None) -> list[int]:
    """[PSS of process `pid` (this one by default) and all its descendants]. A sum of RSS counts each page
    shared by several processes (torch's libraries, mapped by the driver and every worker) once per process;
    PSS splits it among them, so this is the memory the run really holds. Reading it walks each process's
    page tables (~10 ms per 0.5 GB process, slowing the process meanwhile): sample it seconds apart."""
    me = psutil.Process(pid)
    return [sum(_or_zero(p.memory_full_info, "pss") for p in [me, *me.children(recursive=True)])]
