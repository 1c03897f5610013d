"""bench/memory.py: the peak the benchmarks report is the memory the block really held at its highest."""

from __future__ import annotations

import os
import time

from bench.memory import PeakSampler, rss_of


def test_the_peak_holds_memory_allocated_and_freed_inside_the_block():
    with PeakSampler(rss_of([os.getpid()]), 0.02) as peaks:
        block = bytearray(300 * 2**20)  # 300 MiB, written so its pages are resident
        block[::4096] = b"x" * len(block[::4096])
        time.sleep(0.3)  # a few samples while it is held
        del block
    assert peaks.peak[0] - peaks.start[0] >= 250 * 2**20, (peaks.start, peaks.peak)
