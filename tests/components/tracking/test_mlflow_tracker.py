"""The tracker's SQLite store opened by several processes at once."""

from __future__ import annotations

import multiprocessing
import time


def _open(uri: str, start: float) -> None:
    import os

    os.environ["MLFLOW_TRACKING_URI"] = uri
    from components.tracking.mlflow_tracker import setup

    while time.time() < start:  # all at once, as two triggered deployment runs start
        time.sleep(0.001)
    setup("e2e")


def test_runs_starting_at_once_in_a_fresh_checkout_share_its_new_store(tmp_path):
    """Three processes open a store that does not exist yet and ask for the same experiment: each succeeds
    (unlocked, MLflow's table creation raced and every one failed: 'duplicate column name: step'), and the
    store holds that experiment once."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    start = time.time() + 3  # past the children's imports
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_open, args=(uri, start)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    names = [e.name for e in MlflowClient(uri).search_experiments()]
    assert names.count("e2e") == 1, names
