"""Stage timings and start-up phases (components/progress.py)."""

from __future__ import annotations

import time

import pytest

from components.progress import Timer, startup_metrics


def test_timed_blocks_add_up_per_stage_even_when_they_raise():
    timer = Timer()
    for _ in range(2):
        with timer.timed("gen"):
            time.sleep(0.01)
    with pytest.raises(ValueError), timer.timed("reward"):
        raise ValueError
    m = timer.metrics()
    assert m["timing_s/gen"] >= 0.02 and "timing_s/reward" in m
    assert m["timing_s/step"] >= m["timing_s/gen"] + m["timing_s/reward"]


def test_startup_phases_are_the_gaps_between_marks():
    marks = {
        "process": 10.0,
        "imports": 12.0,
        "prefect": 13.5,
        "setup": 14.0,
        "workers": 17.0,
        "first_gen": 18.0,
    }
    assert startup_metrics(marks) == {
        "timing_s/startup/imports": 2.0,
        "timing_s/startup/prefect": 1.5,
        "timing_s/startup/setup": 0.5,
        "timing_s/startup/workers": 3.0,
        "timing_s/startup/first_gen": 8.0,
    }
