"""Asynchronous RL end to end, through the real training flow (Prefect, Ray, MLflow): one_step_off samples
batch k+1 with the weights from before update k, as task runs of their own beside the update on Ray's actors;
a bounded_staleness run with two batches in flight (its engine in the driver's process) that fails after a
checkpoint resumes, in a new run, to the uninterrupted run's model bit for bit (the rollouts sampled ahead,
with weights no checkpoint holds, are in it); LoRA adapters reach an engine in an actor of its own. The
loop's logic (staleness 0 is the synchronous loop, partial rollouts, rebuilds) is tested in seconds in
tests/flows/test_flow_logic.py."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from components.models.loading import load_model
from tests.flows.conftest import latest_checkpoint, sft_ready, task_runs

pytestmark = pytest.mark.slow

ITERATIONS = 2
# the trainer's old log-probs in both loops (asynchronous modes always take them: the PPO ratio is to the
# policy that trains), corrected towards the engine's: the same computation in sync and async
SHARED = [
    "trainer.save_interval=1",
    "trainer.rollout_placement=separate",
    "algorithm.rollout_correction.mode=tis",
]


@pytest.fixture(scope="module")
def start(tmp_path_factory, prefect_harness, ray_local):
    root = tmp_path_factory.mktemp("async")
    with sft_ready(root, ITERATIONS, tuple(SHARED), backend="ray") as ov:
        yield root, ov


def train(start, name: str, *extra: str) -> dict:
    """The run's info, with the id of its Prefect flow run."""
    from flows.train import train_flow

    root, ov = start
    state = train_flow(
        "configs/arith_grpo.yaml", [*ov, f"trainer.output_dir={root}/{name}", *extra], return_state=True
    )
    return {**state.result(), "flow_run_id": state.state_details.flow_run_id}


def history(info: dict, key: str) -> list[float]:
    client = MlflowClient()
    return [m.value for m in sorted(client.get_metric_history(info["run_id"], key), key=lambda m: m.step)]


def same_model(a: dict, b: dict) -> bool:
    ma, mb = load_model(a["final_model"]).state_dict(), load_model(b["final_model"]).state_dict()
    return ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


@pytest.fixture(scope="module")
def one_step_off(start):
    return train(start, "one_step_off", "trainer.async_mode=one_step_off")


def test_one_step_off_samples_with_the_weights_before_the_update_beside_it(one_step_off):
    # batch 1 with the start's weights (version 0, the policy at 0); batch k+1 with version k-1, while the
    # policy, at version k, updates on batch k
    assert history(one_step_off, "async/staleness/max") == [0.0] + [1.0] * (ITERATIONS - 1)
    assert history(one_step_off, "async/staleness/mean") == [0.0] + [1.0] * (ITERATIONS - 1)
    assert history(one_step_off, "async/dropped_samples") == [0.0] * ITERATIONS
    # in Prefect, each iteration's gen and reward as task runs of their own, named by iteration (how long
    # they ran beside the update is timing_s/overlap; the tiny model samples and updates in milliseconds, so
    # its figure is noise here: bench/trl_compare.py measures it on real workloads)
    expected = {f"{s}[it={k}]" for s in ("gen", "reward", "update-actor") for k in range(1, ITERATIONS + 1)}
    assert expected <= task_runs(one_step_off["flow_run_id"], expected).keys()
    overlap = history(one_step_off, "timing_s/overlap")
    assert len(overlap) == ITERATIONS and overlap[-1] == 0.0  # nothing is sampled beside the last update
    weights = history(one_step_off, "rollout_corr/weight_mean")
    assert all(0.5 < w < 2.0 for w in weights)  # importance weights to the policy one version on


def fail_then_resume(start, monkeypatch, name: str, at: int, *extra: str) -> dict:
    """A run that fails in iteration `at`, after checkpoint at - 1, then run again: the resumed run's info."""
    import flows.train as train_module

    real = train_module.compute_advantages

    def fail(batch, *args):
        if batch.meta["iteration"] == at:
            raise RuntimeError(f"injected failure in iteration {at}")
        return real(batch, *args)

    monkeypatch.setattr(train_module, "compute_advantages", fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        train(start, name, *extra)
    root, _ = start
    assert latest_checkpoint(root / name) == f"iter_{at - 1:06d}"
    monkeypatch.setattr(train_module, "compute_advantages", real)
    return train(start, name, *extra)


def test_a_bounded_staleness_run_that_fails_resumes_to_the_uninterrupted_model(start, monkeypatch):
    # two batches sampled ahead (max_staleness 2): checkpoint 1 holds batches 2 and 3, the second sampled with
    # weights no checkpoint holds; the resumed run trains on them and ends where the uninterrupted one does
    mode = ["trainer.async_mode=bounded_staleness", "trainer.max_staleness=2", "trainer.iterations=3"]
    # the engine an object of its own in this process, sampling in Prefect's task threads beside the update:
    # what the checkpoint holds is the flow's (one_step_off above samples beside it on Ray's actors)
    mode += ["trainer.backend=local"]
    whole = train(start, "bounded", *mode)
    assert history(whole, "async/staleness/max") == [0.0, 1.0, 2.0]
    resumed = fail_then_resume(start, monkeypatch, "bounded_failed", 2, *mode)
    for key in ("critic/score/mean", "async/staleness/max", "async/dropped_samples"):
        assert history(resumed, key) == history(whole, key), key
    assert same_model(whole, resumed)


def test_lora_adapters_reach_an_engine_of_its_own(start):
    # the engine in its own actor holds the same adapters over the base and receives them alone after each
    # update: its rollout log-probs then equal the trainer's old log-probs (both float32 on the hf engine),
    # so every importance weight is 1. Adapters that never reached it would give weights far from 1 once the
    # first update moved them (weight_mean 0.994 at iteration 2, checked by skipping the engine's load)
    info = train(
        start, "lora_separate", "actor.lora.rank=8", "actor.lora.alpha=16", "actor.optimizer.lr=1e-2"
    )
    assert len(history(info, "critic/score/mean")) == ITERATIONS
    for key in ("rollout_corr/weight_mean", "rollout_corr/weight_max"):
        assert history(info, key) == pytest.approx([1.0] * ITERATIONS, abs=1e-4)
