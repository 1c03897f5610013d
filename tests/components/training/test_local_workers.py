"""Workers in the driver's own process (trainer.backend=local): the reward scorer's calls stay bounded by the
stage timeout, a scorer's own error reaches the run as it is, and a start the flow abandoned builds no more."""

from __future__ import annotations

import time

import pytest

from components.errors import RewardError, StartAbandoned
from components.plan import make_plan
from components.rewards.registry import REWARDS, scorers_for
from components.rewards.scorer import RewardScorer
from components.training.local_workers import start_local_workers
from components.training.ray_workers import RewardGroup, Started
from components.training.transport import LOCAL, ThreadedActor
from components.validate import load_checked

CFG = load_checked(None)


def local_rewards(timeout_s: float) -> RewardGroup:
    actors = [ThreadedActor(RewardScorer())]
    return RewardGroup(actors, LOCAL.pids(actors), timeout_s, transport=LOCAL)


def score(fn, texts: list[str], timeout_s: float = 1.0):
    REWARDS["test/local"] = lambda rm: fn
    try:
        sources = ["test/local"] * len(texts)
        scorers = scorers_for(sources, CFG)
        return local_rewards(timeout_s).score(texts, ["3"] * len(texts), sources, [{}] * len(texts), scorers)
    finally:
        del REWARDS["test/local"]


def test_a_hung_reward_stops_the_run_at_the_stage_timeout_in_this_process_too():
    def hangs(text, truth, extra):
        time.sleep(30)  # the daemon thread it runs in is left behind

    start = time.monotonic()
    with pytest.raises(
        RewardError, match=r"did not finish within trainer.stage_timeout_s=1 s; it runs in this"
    ):
        score(hangs, ["#### 3"])
    assert time.monotonic() - start < 5


def test_a_scorers_error_and_its_scores_come_back_as_they_would_from_ray():
    assert score(lambda text, truth, extra: float(text == "#### 3"), ["#### 3", "#### 4"]) == (
        [1.0, 0.0],
        [True, True],
        {},
    )

    def buggy(text, truth, extra):
        raise ValueError("bad parse")

    with pytest.raises(RewardError, match=r"failed on sample 0 \(response '#### 3'.*bad parse"):
        score(buggy, ["#### 3"])


def test_an_abandoned_start_builds_nothing_more(tiny_model_dir):
    plan = make_plan(load_checked(None, [f"actor.model.path={tiny_model_dir}", "trainer.backend=local"]))
    started = Started(LOCAL)
    started.abandon()  # the run stopped on a bad input before its workers were up
    with pytest.raises(StartAbandoned):
        start_local_workers(plan, started)
    assert len(started.actors) == 1  # the policy worker, the first it made: no engine, scorer or reference
    workers = start_local_workers(plan, Started(LOCAL))
    assert workers.rollout.colocated and workers.policy.pids == [workers.rewards.pids[0]]
