"""trainer.rollout_placement: an engine colocated in the policy worker samples with the policy's own
parameters (a weight sync copies nothing) and gives exactly the samples of an engine in an actor of its own,
before and after an update; a stale engine is refused either way."""

from __future__ import annotations

import pytest
import torch

from components.data.formats import make_row
from components.errors import ConfigError
from components.plan import make_plan
from components.settings import SamplingParams
from components.training.ray_workers import start_workers
from tests.components.training.test_actor import synthetic_batch
from tests.components.training.test_distributed import config

ROWS = [
    make_row("arith", f"{a}+{b}=", f"#### {a + b}", str(a + b), "train", i)
    for i, (a, b) in enumerate([(1, 2), (10, 31), (7, 7)])
]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)


def samples(placement: str, model_dir, tokenizer) -> tuple[bool, list[torch.Tensor]]:
    workers = start_workers(make_plan(config(model_dir, f"trainer.rollout_placement={placement}")))
    try:
        before = workers.rollout.generate(ROWS, PARAMS, 7, 1, 0)
        workers.policy.update(synthetic_batch(tokenizer, seed=0))
        with pytest.raises(RuntimeError, match="sync weights before sampling"):
            workers.rollout.generate(ROWS, PARAMS, 7, 2, 1)  # the update made version 1
        version = workers.push_weights()
        after = workers.rollout.generate(ROWS, PARAMS, 7, 2, version)
        assert version == 1 and workers.rollout.versions() == [1]
        return workers.rollout.colocated, [
            b.tensors[k] for b in (before, after) for k in ("responses", "rollout_logprobs")
        ]
    finally:
        workers.stop()


def test_colocated_engine_samples_as_a_separate_one_and_follows_updates(ray_up, tiny_model_dir, tokenizer):
    colocated, shared = samples("auto", tiny_model_dir, tokenizer)  # auto: one worker, hf -> colocated
    separate, copied = samples("separate", tiny_model_dir, tokenizer)
    assert colocated and not separate
    for a, b in zip(shared, copied):
        assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-5)
    assert not torch.allclose(shared[1], shared[3])  # the update reached the colocated engine's log-probs


def test_colocation_needs_one_worker_and_the_hf_engine(tiny_model_dir):
    with pytest.raises(ConfigError, match="trainer.rollout_placement=colocate"):
        config(tiny_model_dir, "trainer.rollout_placement=colocate", "trainer.num_workers=2")


def test_a_start_that_fails_or_is_abandoned_partway_leaves_no_actor(ray_up, tiny_model_dir, monkeypatch):
    """The reward scorer's start fails once the policy group is up: the group's actors go too. A start that
    the run abandons (it stopped on a bad input) fails at its next wait, and starts nothing more."""
    from components.errors import StartAbandoned
    from components.training import ray_workers
    from tests.conftest import descendants
    from tests.flows.conftest import poll

    plan = make_plan(config(tiny_model_dir, "trainer.rollout_placement=separate"))

    def fails(*_a, **_k):
        raise RuntimeError("the reward scorer could not start")

    monkeypatch.setattr(ray_workers, "start_reward_group", fails)
    with pytest.raises(RuntimeError, match="could not start"):
        start_workers(plan)
    titles = ("ray::PolicyWorker", "ray::RolloutWorker")
    assert poll(lambda: [p for t in titles for p in descendants(t)], lambda left: not left, 30) == []

    started = ray_workers.Started()
    started.abandon()  # before the first actor: each is killed as it is made, and the start stops there
    with pytest.raises(StartAbandoned):
        start_workers(plan, started)
    assert len(started.actors) == 1  # the policy worker, and nothing after it
    assert poll(lambda: [p for t in titles for p in descendants(t)], lambda left: not left, 30) == []
