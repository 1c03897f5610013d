"""bench/memory.py: the peak the benchmarks report is the memory the block really held at its highest."""

from __future__ import annotations

import time

from bench.memory import PeakSampler, rss_of_tree


def test_the_peak_holds_memory_allocated_and_freed_inside_the_block():
    with PeakSampler(rss_of_tree, 0.02) as peaks:
        block = bytearray(300 * 2**20)  # 300 MiB, written so its pages are resident
        block[::4096] = b"x" * len(block[::4096])
        time.sleep(0.3)  # a few samples while it is held
        del block
    assert peaks.peak[0] - peaks.start[0] >= 250 * 2**20, (peaks.start, peaks.peak)
    assert peaks.peak[1] >= peaks.peak[0]  # the tree's RSS includes this process's own


def test_the_peak_of_another_process_counts_its_descendants():
    import subprocess
    import sys
    from functools import partial

    # a process whose child holds 200 MiB for a moment: what a run's Ray workers are to its driver
    hold = "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(0.6)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {hold!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent])
    with PeakSampler(partial(rss_of_tree, proc.pid), 0.02) as peaks:
        proc.wait()
    assert peaks.peak[1] - peaks.peak[0] >= 180 * 2**20, peaks.peak  # the child's, not the parent's own
