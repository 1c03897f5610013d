"""The training flow's own logic in seconds: `train`, `iteration`, `collect` and `recover` of flows/train.py,
unchanged, driving the workers in this process (components/training/local_workers.py: the same typed groups,
no Ray) inside a Prefect flow, with MLflow on a temporary SQLite file. Staleness, dynamic sampling, partial
rollouts and rebuilds are checked here; tests/flows/test_async.py and test_faults.py keep one end-to-end run
each on Ray."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from components.models.loading import load_model
from components.training.ray_workers import StageTimeout
from tests.flows.local import ITERATIONS, overrides, run_locally


def history(info: dict, key: str) -> list[float]:
    client = MlflowClient()
    return [m.value for m in sorted(client.get_metric_history(info["run_id"], key), key=lambda m: m.step)]


def weights(info: dict) -> dict[str, torch.Tensor]:
    return load_model(info["final_model"]).state_dict()


def same(a: dict, b: dict) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def root(local_root):
    return local_root


@pytest.fixture(scope="module")
def sync(root, tiny_model_dir):
    return run_locally(overrides(root, "sync", tiny_model_dir, "trainer.rollout_placement=separate"))


def test_the_synchronous_loop_logs_every_iteration_once_with_its_stage_timings(sync):
    assert [h["step"] for h in sync["history"]] == [1, 2, 3]
    assert len(history(sync, "critic/score/mean")) == ITERATIONS
    for key in ("timing_s/gen", "timing_s/reward", "timing_s/adv", "timing_s/update_actor", "timing_s/step"):
        assert all(h[key] >= 0 for h in sync["history"]), key
    assert all(h["timing_s/step"] >= h["timing_s/gen"] for h in sync["history"])


def test_bounded_staleness_zero_is_the_synchronous_loop(root, tiny_model_dir, sync):
    """max_staleness 0 samples nothing ahead: the same rollouts, the same model, bit for bit."""
    extra = ("trainer.rollout_placement=separate", "trainer.async_mode=bounded_staleness")
    info = run_locally(overrides(root, "stale0", tiny_model_dir, *extra, "trainer.max_staleness=0"))
    assert history(info, "critic/score/mean") == history(sync, "critic/score/mean")
    assert history(info, "async/staleness/max") == [0.0] * ITERATIONS
    assert same(info, sync)


def test_one_step_off_samples_each_batch_with_the_weights_before_the_update(root, tiny_model_dir):
    extra = ("trainer.rollout_placement=separate", "trainer.async_mode=one_step_off")
    info = run_locally(overrides(root, "one_step_off", tiny_model_dir, *extra))
    # iteration 1 sampled with the starting weights (version 0) while nothing trained; from iteration 2 on
    # each batch was sampled beside the update before it, one version behind
    assert history(info, "async/staleness/max") == [0.0, 1.0, 1.0]
    assert history(info, "async/dropped_samples") == [0.0, 0.0, 0.0]


def test_two_batches_in_flight_train_up_to_two_versions_behind(root, tiny_model_dir):
    """max_staleness 2 samples iterations 1-3 at once with the starting weights: iteration k trains on samples
    k - 1 versions old, none past the bound, none dropped."""
    extra = (
        "trainer.rollout_placement=separate",
        "trainer.async_mode=bounded_staleness",
        "trainer.max_staleness=2",
    )
    info = run_locally(overrides(root, "stale2", tiny_model_dir, *extra))
    assert history(info, "async/staleness/max") == [0.0, 1.0, 2.0]
    assert history(info, "async/dropped_samples") == [0.0, 0.0, 0.0]


def test_partial_rollouts_stay_within_their_bound(root, tiny_model_dir):
    extra = (
        "trainer.rollout_placement=separate",
        "trainer.async_mode=bounded_staleness",
        "trainer.max_staleness=1",
        "trainer.partial_rollouts=true",
    )
    info = run_locally(overrides(root, "partial", tiny_model_dir, *extra))
    assert max(history(info, "async/staleness/max")) <= 1
    assert len(history(info, "critic/score/mean")) == ITERATIONS
    # those sampled after an update landed mid-rollout are counted (where it lands depends on timing:
    # tests/components/rollout/test_worker.py pins it down)
    partial = history(info, "async/partial_samples")
    assert len(partial) == ITERATIONS and all(p >= 0 for p in partial)


def test_dynamic_sampling_generates_more_rounds_until_the_groups_differ(root, tiny_model_dir):
    """DAPO keeps the first data.batch_size groups whose rewards differ, over at most max_num_gen_batches
    rounds; each round draws new prompts."""
    info = run_locally(
        overrides(root, "dapo", tiny_model_dir, "algorithm.name=dapo", "algorithm.max_num_gen_batches=3")
    )
    rounds, kept = history(info, "dynamic_sampling/gen_rounds"), history(info, "dynamic_sampling/groups_kept")
    assert len(rounds) == ITERATIONS and all(1 <= r <= 3 for r in rounds)
    assert all(k <= 4 for k in kept)
    assert all(r == 3 for r, k in zip(rounds, kept) if k < 4)  # fewer groups only when the rounds ran out


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_a_worker_lost_mid_iteration_is_rebuilt_from_the_checkpoint_to_the_same_model(
    root, tiny_model_dir, mode, sync
):
    """The update of iteration 2 fails twice (a hung call killed): the workers are rebuilt twice from
    iteration 1's checkpoint, each iteration is logged once, and the run ends on the uninterrupted model."""
    extra = ("trainer.rollout_placement=separate", f"trainer.async_mode={mode}")
    ov = overrides(root, f"rebuilt_{mode}", tiny_model_dir, *extra, "trainer.max_worker_rebuilds=2")
    info = run_locally(ov, fail={"iteration": 2, "times": 2})
    assert info["starts"] == 3
    assert [h["step"] for h in info["history"]] == [1, 2, 3]
    assert len(history(info, "critic/score/mean")) == ITERATIONS
    reference = (
        sync if mode == "sync" else run_locally(overrides(root, f"clean_{mode}", tiny_model_dir, *extra))
    )
    assert same(info, reference)


def test_a_rebuild_that_fails_as_it_starts_is_tried_again_and_counted(root, tiny_model_dir, sync):
    """A node lost mid-run: the rebuild's first start fails too (Ray still counts the dead node's resources),
    the next one takes; each try counts toward trainer.max_worker_rebuilds, and the run ends on the
    uninterrupted model. One try fewer allowed ends the run with that failure."""
    fail = {"iteration": 2, "times": 1, "rebuilds_failing": 1}
    separate = "trainer.rollout_placement=separate"  # as the `sync` run samples
    ov = overrides(root, "rebuild_retried", tiny_model_dir, separate, "trainer.max_worker_rebuilds=2")
    info = run_locally(ov, fail=dict(fail))
    assert info["starts"] == 3 and [h["step"] for h in info["history"]] == [1, 2, 3]
    assert len(history(info, "critic/score/mean")) == ITERATIONS and same(info, sync)
    ov = overrides(root, "rebuild_given_up", tiny_model_dir, separate, "trainer.max_worker_rebuilds=1")
    with pytest.raises(ConnectionError, match="node lost as the group started"):
        run_locally(ov, fail=dict(fail))


def test_more_failures_than_trainer_max_worker_rebuilds_end_the_run(root, tiny_model_dir):
    ov = overrides(root, "gives_up", tiny_model_dir, "trainer.max_worker_rebuilds=1")
    with pytest.raises(StageTimeout, match="injected"):
        run_locally(ov, fail={"iteration": 2, "times": 5})
