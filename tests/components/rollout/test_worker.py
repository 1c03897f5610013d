"""The rollout worker with partial rollouts (trainer.partial_rollouts): an update announced while a training
rollout samples stops its samples after the current decode step, is loaded, and the unfinished samples are
finished with the new weights (flagged; each token's log-prob is the policy's that sampled it); without
partial rollouts the update waits for the rollout's end. Here in threads (deterministically: the update is
announced before the first decode step), then through a Ray actor and its concurrency group for updates, as
the training flow runs it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from components.errors import ConfigError
from components.models.loading import load_model
from components.rollout.worker import RolloutWorker
from components.settings import RolloutSettings, SamplingParams
from components.training.logprobs import batch_logprobs
from components.validate import load_checked
from tests.conftest import arith_rows, make_model

ROWS = arith_rows(8)
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)


def announce_update_first(worker: RolloutWorker, state: dict) -> threading.Thread:
    """The engine's first generation starts an update in another thread (as Ray's update group runs it) and
    samples only once the update is announced: the rollout is interrupted after its first decode step."""
    real, thread = worker.engine.generate, threading.Thread(target=worker.update_weights, args=(state, 1))

    def generate(*args, **kwargs):
        if thread.ident is None:
            thread.start()
            while not worker.update_waiting.is_set():
                time.sleep(0.001)
        return real(*args, **kwargs)

    worker.engine.generate = generate
    return thread


def test_an_update_mid_rollout_finishes_the_samples_with_the_new_weights(tiny_model_dir, tokenizer):
    worker = RolloutWorker(str(tiny_model_dir), partial=True)
    new = make_model(tokenizer, seed=1)
    thread = announce_update_first(worker, new.state_dict())
    batch = worker.generate(ROWS, PARAMS, seed=5, iteration=1, expect_version=0)
    thread.join()
    t, mask = batch.tensors, batch.tensors["response_mask"]
    lengths = mask.sum(-1)
    assert (
        worker.weights_version() == 1 and t["sample_version"].tolist() == [0] * 16
    )  # the version it began with
    assert t["partial_rollout"].tolist() == (lengths > 1).tolist()  # all but those that ended at once
    assert t["partial_rollout"].sum() >= 12
    # token 0 sampled by the old weights, the rest by the new ones (the same prefix prefilled again)
    old_lp = batch_logprobs(load_model(tiny_model_dir), batch, 1.0, None) * mask
    new_lp = batch_logprobs(new, batch, 1.0, None) * mask
    torch.testing.assert_close(t["rollout_logprobs"][:, 0], old_lp[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(t["rollout_logprobs"][:, 1:], new_lp[:, 1:], atol=1e-5, rtol=0)
    assert not torch.allclose(t["rollout_logprobs"][:, 1:], old_lp[:, 1:], atol=1e-3)
    assert (lengths <= PARAMS.max_new_tokens).all()


def test_without_partial_rollouts_an_update_waits_for_the_rollouts_end(tiny_model_dir, tokenizer):
    worker = RolloutWorker(str(tiny_model_dir))
    thread = announce_update_first(worker, make_model(tokenizer, seed=1).state_dict())
    batch = worker.generate(ROWS, PARAMS, seed=5, iteration=1, expect_version=0)
    thread.join()
    assert batch.tensors["sample_version"].tolist() == [0] * 16
    assert not batch.tensors["partial_rollout"].any()
    old_lp = batch_logprobs(load_model(tiny_model_dir), batch, 1.0, None) * batch.tensors["response_mask"]
    torch.testing.assert_close(batch.tensors["rollout_logprobs"], old_lp, atol=1e-5, rtol=0)
    assert worker.weights_version() == 1


def test_with_partial_rollouts_an_engine_ahead_is_taken_and_one_behind_refused(tiny_model_dir):
    # an update that landed while this call waited: newer weights are taken, older ones refused
    worker = RolloutWorker(str(tiny_model_dir), partial=True)
    worker.update_weights(load_model(tiny_model_dir).state_dict(), 2)
    assert (
        worker.generate(ROWS[:2], PARAMS, 0, 1, expect_version=1).tensors["sample_version"].tolist()
        == [2] * 4
    )
    with pytest.raises(RuntimeError, match="holds weights version 2, the policy is at 3"):
        worker.generate(ROWS[:2], PARAMS, 0, 1, expect_version=3)


def test_evaluation_is_never_interrupted(tiny_model_dir):
    worker = RolloutWorker(str(tiny_model_dir), partial=True)
    calls, real = [], worker.engine.generate
    worker.engine.generate = lambda *a, **k: calls.append(k) or real(*a, **k)
    worker.update_waiting.set()  # an update announced: a training rollout would stop for it
    batch = worker.generate(ROWS, PARAMS, 0, -1, expect_version=0)
    assert calls == [{}] and not batch.tensors["partial_rollout"].any()


def test_through_ray_an_update_does_not_wait_for_the_rollout_in_flight(tiny_model_dir, tokenizer, ray_local):
    import ray

    from components.settings import EngineOptions
    from components.training.ray_workers import UPDATES, start_engine

    settings = RolloutSettings(str(tiny_model_dir), options=EngineOptions(dtype="float32"), partial=True)
    engine = start_engine(settings, SimpleNamespace(num_engines=1, engine_gpus=0, rollout_resources={}))
    ray.get(engine.health.remote())
    rows = ROWS * 16  # 128 rows x 2 samples of up to 48 tokens: the rollout takes a noticeable while
    gen = engine.generate.remote(rows, SamplingParams(n=2, temperature=1.0, max_new_tokens=48), 0, 1, 0)
    probe = engine.__ray_call__.options(concurrency_group=UPDATES)
    while not ray.get(probe.remote(lambda w: w.engine_lock.locked())):  # the rollout has begun
        time.sleep(0.005)
    state = make_model(tokenizer, seed=1).state_dict()
    assert ray.get(engine.update_weights.options(concurrency_group=UPDATES).remote(state, 1)) == 1
    assert ray.wait([gen], timeout=0)[1] == [gen]  # it landed while the rollout still ran
    batch = ray.get(gen)
    assert batch.tensors["partial_rollout"].any() and (batch.tensors["sample_version"] == 0).all()
    assert ray.get(engine.weights_version.remote()) == 1
    ray.kill(engine)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["trainer.partial_rollouts=true"],
            r"trainer\.partial_rollouts=true with trainer\.async_mode=sync: ",
        ),
        (
            ["trainer.partial_rollouts=true", "trainer.async_mode=one_step_off"],
            r"async_mode=one_step_off: one_step_off samples exactly one version behind",
        ),
        (
            [
                "trainer.partial_rollouts=true",
                "trainer.async_mode=bounded_staleness",
                "trainer.max_staleness=0",
            ],
            r"async_mode=bounded_staleness and trainer\.max_staleness=0: nothing is sampled ahead",
        ),
        (
            ["trainer.partial_rollouts=true", "trainer.async_mode=bounded_staleness", "engine.type=sglang"],
            r"partial_rollouts=true with engine\.type=sglang: .* of the engines hf, vllm stop mid-way",
        ),
        (
            [
                "trainer.partial_rollouts=true",
                "trainer.async_mode=bounded_staleness",
                "multi_turn.enable=true",
            ],
            r"partial_rollouts=true with multi_turn\.enable=true: .*unset trainer\.partial_rollouts",
        ),
    ],
)
def test_partial_rollouts_where_they_cannot_happen_are_refused_naming_the_key(
    tiny_model_dir, overrides, match
):
    with pytest.raises(ConfigError, match=match):
        load_checked(None, [f"actor.model.path={tiny_model_dir}", *overrides])


def test_a_mixture_plays_each_rows_environment_and_reports_each_under_its_name(tiny_model_dir, monkeypatch):
    """multi_turn.envs: rows of `game/*` play an environment that opens with its own message and rewards the
    episode, rows of `calc` the tools environment (the tools' schemas in their prompts alone), the rest
    multi_turn.env=single; the batch says each sample's environment, and the figures are per environment."""
    import math

    from components.envs import base
    from components.envs.base import Step
    from components.rl import env_metrics
    from components.rollout import worker as worker_module
    from components.settings import MultiTurnSettings

    class Opening:
        def reset(self, row, seed):
            return [{"role": "user", "content": "play"}]

        def step(self, text, last_turn):
            return Step(reward=1.0, done=True, counts={"moves": 1.0})

    monkeypatch.setitem(base.ENVS, "opening", lambda settings, tools: Opening)
    monkeypatch.setitem(base.COUNTERS, "opening", ("moves",))
    encoded = []

    def encode_prompt(tokenizer, prompt, settings, tools=None):
        encoded.append((prompt, tools))
        return real(tokenizer, prompt, settings, tools)

    real = worker_module.encode_prompt
    monkeypatch.setattr(worker_module, "encode_prompt", encode_prompt)
    mixture = (("game/*", "opening"), ("calc", "tools"))
    settings = MultiTurnSettings(2, ("calculator",), 64, env="single", envs=mixture)
    worker = RolloutWorker(str(tiny_model_dir), multi_turn=settings)
    rows = [{**r, "data_source": s} for r, s in zip(arith_rows(3), ["arith", "game/x", "calc"])]
    batch = worker.generate(rows, SamplingParams(n=2, max_new_tokens=4), seed=0, iteration=-1)

    assert batch.non_tensors["env"] == ["single"] * 2 + ["opening"] * 2 + ["tools"] * 2
    assert [p for p, _ in encoded] == [
        rows[0]["prompt"],
        [{"role": "user", "content": "play"}],
        rows[2]["prompt"],
    ]
    assert [t is not None for _, t in encoded] == [False, False, True]  # the tools' schemas for `calc` alone
    t = batch.tensors
    assert t["num_turns"][:4].tolist() == [1, 1, 1, 1]  # a single turn, and a game its first move ends
    assert all(math.isnan(r) for r in t["env_reward"][:2].tolist()) and t["env_reward"][2:4].tolist() == [
        1.0,
        1.0,
    ]
    assert t["env_count/moves"].tolist() == [0, 0, 1, 1, 0, 0]
    assert t["env_count/tool_calls"].shape == (6,)  # declared by tools: there with no call made
    figures = env_metrics(batch)
    assert figures["env/opening/reward"] == 1.0 and figures["env/opening/moves"] == 1.0
    assert figures["env/single/turns"] == 1.0 and "env/single/reward" not in figures
    assert "env/single/moves" not in figures and "env/opening/tool_calls" not in figures
    assert "env/tools/tool_calls" in figures and "env/tools/moves" not in figures
