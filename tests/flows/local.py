"""The training flow on workers in this process (components/training/local_workers.py): flows/train.py's own
`train` (and so `iteration`, `collect`, `recover`) inside a Prefect flow, with MLflow on a temporary SQLite file
and a tiny random model. What the fast tests of the flow's logic and of every preset drive."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from prefect import flow

from components.data.formats import row_schema
from components.data.io import write_parquet
from components.models.loading import load_tokenizer
from components.plan import make_plan
from components.training.local_workers import start_local_workers
from components.training.ray_workers import StageTimeout
from components.validate import load_checked
from flows.train import train
from tasks.tracking import open_run
from tests.conftest import arith_rows

ITERATIONS = 3


@pytest.fixture(scope="module")
def local_root(tmp_path_factory, tiny_model_dir, prefect_harness):
    root = tmp_path_factory.mktemp("flow_logic")
    rows = arith_rows(24)
    schema = row_schema("text")
    write_parquet(rows[:16], root / "train.parquet", schema)
    write_parquet(rows[16:], root / "test.parquet", schema)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root}/mlflow.db"
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
    policy update of iteration k raises a transient failure (a hung call killed) its first n times; with
    "rebuilds_failing": m, the first m rebuilds fail as they start (a node lost as the group starts)."""
    cfg = load_checked("configs/arith_grpo.yaml", ov)
    plan = make_plan(cfg)
    tokenizer = load_tokenizer(cfg.actor.model.path)
    from tasks.data import load_datasets

    run = open_run(cfg, plan, tokenizer, load_datasets.fn(cfg, tokenizer), "", "")
    starts: list[int] = []

    def start(plan):
        starts.append(1)
        if fail and len(starts) > 1 and fail.get("rebuilds_failing", 0) > 0:
            fail["rebuilds_failing"] -= 1
            raise ConnectionError("injected: a node lost as the group started")
        workers = start_local_workers(plan)
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
    try:
        info = train(run, Started(start(plan)), time.perf_counter())
    finally:
        run.lock.release()  # as the training flow does: a later run in this process may continue this one
    return {**info, "starts": len(starts), "history": run.history}
