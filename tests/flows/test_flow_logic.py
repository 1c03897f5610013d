"""The training flow's own logic in seconds: `train`, `iteration`, `collect` and `recover` of flows/train.py,
unchanged, driving the workers in this process (components/training/local_workers.py: the same typed groups,
no Ray) inside a Prefect flow, with MLflow on a temporary SQLite file. Staleness, dynamic sampling, partial
rollouts and rebuilds are checked here; tests/flows/test_async.py and test_faults.py keep one end-to-end run
each on Ray."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect import flow

from components.config import load_config
from components.data.formats import row_schema
from components.data.io import write_parquet
from components.models.loading import load_model, load_tokenizer
from components.plan import make_plan
from components.training.local_workers import start_local_workers
from components.training.ray_workers import StageTimeout
from flows.train import train
from tasks.tracking import open_run
from tests.conftest import arith_rows

ITERATIONS = 3


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_model_dir, prefect_harness):
    root = tmp_path_factory.mktemp("flow_logic")
    rows = arith_rows(24)
    schema = row_schema("text")
    write_parquet(rows[:16], root / "train.parquet", schema)
    write_parquet(rows[16:], root / "test.parquet", schema)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root}/mlruns.db"
    yield root
    os.environ.pop("MLFLOW_TRACKING_URI")


def overrides(root: Path, name: str, model: Path, *extra: str) -> list[str]:
    return [
        f"trainer.run_dir={root}",
        f"data.train_path={root}/train.parquet",
        f"data.eval_path={root}/test.parquet",
        f"data.raw_dir={root}/raw",
        f"data.quarantine_dir={root}/quarantine",
        f"sft.output_dir={root}/sft",
        f"actor.model.path={model}",
        f"trainer.output_dir={root}/{name}",
        "data.batch_size=4",
        "engine.n=4",
        "engine.max_new_tokens=6",
        f"trainer.iterations={ITERATIONS}",
        "trainer.save_interval=1",
        "trainer.test_interval=100",
        "trainer.eval_size=4",
        "trainer.eval_k=1",
        "trainer.progress=false",
        "trainer.experiment_name=flow_logic",
        "actor.optimizer.lr=1e-2",
        # partial credit for any number: a random model's groups still differ now and then
        "reward_model.method=flexible",
        "reward_model.format_score=0.1",
        *extra,
    ]


class Started:
    """What train() takes the started workers from (the flow's StartingWorkers, here already started)."""

    def __init__(self, workers):
        self.workers = workers

    def take(self):
        return self.workers


@flow(name="flow-logic")
def run_locally(ov: list[str], fail: dict | None = None) -> dict:
    """The training flow's train() on workers in this process; `fail` = {"iteration": k, "times": n}: the
    policy update of iteration k raises a transient failure (a hung call killed) its first n times."""
    cfg = load_config("configs/arith_grpo.yaml", ov)
    plan = make_plan(cfg)
    tokenizer = load_tokenizer(cfg.actor.model.path)
    from tasks.data import load_datasets

    run = open_run(cfg, plan, tokenizer, load_datasets.fn(cfg, tokenizer), "", "")
    starts: list[int] = []

    def start(plan):
        workers = start_local_workers(plan)
        starts.append(1)
        if fail:
            real = workers.policy.update

            def update(batch):
                if run.iteration == fail["iteration"] and fail["times"] > 0:
                    fail["times"] -= 1
                    raise StageTimeout("policy worker: update did not finish (injected)")
                return real(batch)

            workers.policy.update = update
        return workers

    run.start_workers = start
    info = train(run, Started(start(plan)), time.perf_counter())
    return {**info, "starts": len(starts), "history": run.history}


def history(info: dict, key: str) -> list[float]:
    client = MlflowClient()
    return [m.value for m in sorted(client.get_metric_history(info["run_id"], key), key=lambda m: m.step)]


def weights(info: dict) -> dict[str, torch.Tensor]:
    return load_model(info["final_model"]).state_dict()


def same(a: dict, b: dict) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


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


def test_more_failures_than_trainer_max_worker_rebuilds_end_the_run(root, tiny_model_dir):
    ov = overrides(root, "gives_up", tiny_model_dir, "trainer.max_worker_rebuilds=1")
    with pytest.raises(StageTimeout, match="injected"):
        run_locally(ov, fail={"iteration": 2, "times": 5})
