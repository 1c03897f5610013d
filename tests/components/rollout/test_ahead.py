"""The queue of rollouts sampled ahead (components/rollout/ahead.py), on plain futures: no Prefect, no Ray."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from components.batch import Batch
from components.rollout.ahead import AheadQueue


def done(value) -> Future:
    f = Future()
    f.set_result(value)
    return f


def rollout(it: int, window: tuple[float, float]) -> tuple[Future, Future]:
    batch = Batch({"responses": torch.full((2, 3), it)}, {}, {"iteration": it, "gen_window": window})
    return done(batch), done((batch, {"critic/score/mean": float(it)}))


def test_fill_submits_in_order_up_to_the_depth_and_never_past_the_last():
    queue, submitted = AheadQueue(depth=2, last=4), []

    def submit(it):
        submitted.append(it)
        return rollout(it, (it, it + 0.5))

    queue.fill(1, submit, lambda: 0.0)
    assert submitted == [1, 2, 3]
    assert queue.take(1).result()[1] == {"critic/score/mean": 1.0}
    queue.fill(2, submit, lambda: 0.0)  # 2 and 3 already queued
    queue.fill(3, submit, lambda: 0.0)
    assert submitted == [1, 2, 3, 4]  # 5 is past the last iteration
    assert [a.iteration for a in queue.items] == [2, 3, 4]


def test_windows_wait_or_count_a_running_generation_up_to_now():
    queue = AheadQueue(depth=0, last=10)  # this iteration's alone
    running = Future()
    queue.fill(1, lambda it: (running, Future()), lambda: 5.0)
    assert queue.windows(now=7.0, wait=False) == [(5.0, 7.0)]  # submitted at 5, still running at 7
    running.set_result(Batch({}, {}, {"gen_window": (5.5, 6.5)}))
    assert queue.windows(now=9.0, wait=False) == [(5.5, 6.5)]
    assert queue.windows(now=9.0, wait=True) == [(5.5, 6.5)]


def test_the_queued_rollouts_round_trip_through_checkpoint_files(tmp_path):
    queue = AheadQueue(depth=2, last=10)
    queue.fill(3, lambda it: rollout(it, (0.0, 1.0)), lambda: 0.0)
    for name, data in queue.files().items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    restored = AheadQueue(depth=2, last=10)
    restored.restore(tmp_path)
    assert [a.iteration for a in restored.items] == [3, 4, 5]
    batch, metrics = restored.take(4).result()
    assert (
        torch.equal(batch.tensors["responses"], torch.full((2, 3), 4)) and metrics["critic/score/mean"] == 4.0
    )
    assert restored.items[0].gen_window() is None  # restored: it sampled in another process's lifetime
