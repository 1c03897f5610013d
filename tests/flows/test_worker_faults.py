"""Faults in the workers' processes. 6: rewards are scored in a Ray task; a scorer whose process dies is retried
with identical results, one that raises (our bug) fails at once, names the sample, and is not retried.
7: a worker call that hangs is stopped at the stage timeout, with no process of it left behind."""

from __future__ import annotations

import os

import pytest

from components.rewards.registry import REWARDS, score_with_config, scorers_for
from components.settings import RewardSettings
from components.training.ray_workers import start_reward_group
from components.validate import load_checked

CFG = load_checked(None)
TEXTS = ["#### 3", "die", "#### 4", "#### 5"]
TRUTHS = ["3", "3", "4", "6"]


def score_in_worker(texts, truths, sources, extras, scorers):
    """The run's reward group (the RewardScorer actor) scoring once, then stopped."""
    rewards = start_reward_group(RewardSettings(overlong=(0, 0, 0.0)))
    try:
        return rewards.score(texts, truths, sources, extras, scorers)
    finally:
        rewards.stop()


def test_scorer_process_death_is_retried_with_identical_results(tmp_path, ray_local):
    marker = str(tmp_path / "died_once")

    def dying(text, truth, extra):  # a closure: shipped by value to the Ray worker
        if text == "die" and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # the worker process dies mid-batch, once
        return float(text.removeprefix("#### ") == truth)

    REWARDS["test/dies"] = lambda rm: dying
    try:
        scored = score_in_worker(TEXTS, TRUTHS, ["test/dies"] * 4, [{}] * 4, scorers_for(["test/dies"], CFG))
        expected = score_with_config(TEXTS, TRUTHS, ["test/dies"] * 4, [{}] * 4, CFG)
    finally:
        del REWARDS["test/dies"]
    assert os.path.exists(marker)
    assert scored == expected == ([1.0, 0.0, 1.0, 0.0], [True] * 4, {})


def test_a_raising_scorer_fails_fast_naming_the_sample(tmp_path, ray_local):
    attempts = tmp_path / "attempts"

    def buggy(text, truth, extra):
        with open(attempts, "a") as f:
            f.write(text + "\n")
        if text == "#### 4":
            raise ValueError("bad parse")
        return 1.0

    REWARDS["test/raises"] = lambda rm: buggy
    try:
        with pytest.raises(Exception, match=r"failed on sample 2 \(response '#### 4'.*bad parse"):
            score_in_worker(TEXTS, TRUTHS, ["test/raises"] * 4, [{}] * 4, scorers_for(["test/raises"], CFG))
    finally:
        del REWARDS["test/raises"]
    assert attempts.read_text().splitlines() == TEXTS[:3]  # one attempt, stopped at the bad sample


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_hung_worker_call_is_stopped_at_its_timeout_with_no_process_left(tmp_path, ray_local):
    import subprocess
    import sys
    import time

    import ray

    from components.training.ray_workers import PolicyGroup, StageTimeout

    child_file = tmp_path / "child_pid"

    class Hangs:  # a local class: shipped by value to the worker
        def pid(self):
            return os.getpid()

        def work(self):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            child_file.write_text(str(child.pid))
            time.sleep(600)  # hangs, ignoring everything

    actor = ray.remote(num_cpus=0, max_restarts=0)(Hangs).remote()
    pid = ray.get(actor.pid.remote())
    policy = PolicyGroup([actor], [pid], timeout_s=3)
    start = time.time()
    with pytest.raises(StageTimeout, match=r"policy worker: work did not finish within 3 s .*were killed"):
        policy.wait([actor.work.remote()], "work")
    assert time.time() - start < 30
    child = int(child_file.read_text())
    deadline = time.time() + 10
    while time.time() < deadline and (_alive(pid) or _alive(child)):
        time.sleep(0.1)
    assert not _alive(pid) and not _alive(child)
    assert issubclass(StageTimeout, TimeoutError)  # a timeout is transient: the flow rebuilds the worker
