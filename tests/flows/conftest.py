"""Flow tests run on real Prefect (test harness), MLflow (SQLite in a temp dir) and Ray (local)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect API server for the whole session (Prefect's test harness: a temporary database, the server a
    child process of this one), yielding its URL. In-process flows report to it, and so do the flows the tests
    run in subprocesses (`dvc repro` stages, nightly runs) when given PREFECT_API_URL; each would otherwise
    start Prefect's in-process server, 10-20 s apiece on 2 cores."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # a deployment run that finds its concurrency slot taken (the nightly's limit of 1) is scheduled again 2 s
    # later, not Prefect's 30 (the work-pool test's second run waits for the first)
    os.environ.setdefault("PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS", "2")
    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def prefect_harness(prefect_api):
    """In-process flows run against the session's Prefect server."""
    yield


def poll(read, done, timeout_s: float = 60.0):
    """read() again every half second until done(what it read) or `timeout_s` passes; the last read. For what
    the Prefect server records after a flow returns: task run states arrive as events and run logs in batches
    every few seconds, and the server runs niced, so under load the last ones land seconds later."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def task_runs(flow_run_id, expected=(), timeout_s: float = 60.0) -> dict:
    """{task run name: task run} of a flow run, read from the Prefect server until it holds every name in
    `expected` and all are in a final state (or `timeout_s` passes)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    runs_of_flow = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        return poll(
            lambda: {r.name: r for r in client.read_task_runs(flow_run_filter=runs_of_flow)},
            lambda runs: all(n in runs and runs[n].state and runs[n].state.is_final() for n in expected),
            timeout_s,
        )


def merged(*groups) -> list[str]:
    """Override lists as one, each key once, a later group's value replacing an earlier's: what a command line
    (or a pipeline's parameters) takes, as it refuses a key given twice."""
    out: dict[str, str] = {}
    for group in groups:
        for item in group:
            out[item.partition("=")[0].strip()] = item
    return list(out.values())


def small_overrides(root, iterations=4, backend: str = "local") -> list[str]:
    """A shrunken default pipeline whose every output lives under `root`. Its workers run in the test's
    process (trainer.backend=local: no Ray to start, ~10 CPU-seconds less per run on 2 cores) unless
    `backend` is ray: the tests of what Ray's actors do (the pipeline end to end, dead and hung workers,
    signals, asynchronous engines, several workers) ask for it."""
    from bench.paths import paths_under

    return [
        f"trainer.backend={backend}",
        *paths_under(root),
        "data.num_train=120",
        "data.num_eval=16",
        "data.max_operand=20",
        "data.batch_size=8",
        "engine.n=4",
        "engine.max_new_tokens=8",
        "sft.hidden_size=32",
        "sft.num_layers=1",
        "sft.num_heads=2",
        "sft.intermediate_size=64",
        f"trainer.iterations={iterations}",
        "trainer.test_interval=2",
        "trainer.save_interval=2",
        "trainer.eval_k=2",
        "trainer.progress=false",
        "trainer.experiment_name=e2e",
        "actor.optimizer.lr=1e-3",
        # partial credit for any number, so a barely-trained model still gets unequal rewards in a group
        "reward_model.method=flexible",
        "reward_model.format_score=0.1",
        "sft.steps=60",
    ]


@contextmanager
def sft_ready(
    root,
    iterations: int = 4,
    extra: tuple[str, ...] = (),
    config: str = "configs/arith_grpo.yaml",
    backend: str = "local",
):
    """MLflow in `root`, the data prepared and cleaned and the SFT model trained there; yields the overrides
    (small_overrides', workers where `backend` says)."""
    import shutil

    from flows.data import data_flow
    from flows.sft import sft_flow

    before = os.environ.get("MLFLOW_TRACKING_URI")  # an enclosing sft_ready's (a module fixture's), restored
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root}/mlflow.db"
    ov = merged(small_overrides(root, iterations, backend), extra)
    # the data and SFT model depend only on the config and its data./sft. keys: made once per session for
    # them, then copied into each module's root (its own copy, ~2 MB; ~25 s of CPU saved each time)
    key = (config, tuple(o for o in extra if o.split("=", 1)[0].startswith(("data.", "sft."))))
    try:
        made = _PREPARED.get(key)
        if made is None or not all((made / d).is_dir() for d in _PREPARED_DIRS):
            data_flow(config, ov)
            sft_flow(config, ov)
            _PREPARED[key] = Path(root)
        elif made != Path(root):
            for d in _PREPARED_DIRS:
                shutil.copytree(made / d, Path(root) / d, dirs_exist_ok=True)
        yield ov
    finally:
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI")
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before


# what data_flow and sft_flow write under a root (small_overrides' paths), and the roots that hold them
_PREPARED_DIRS = ("raw", "clean", "quarantine", "sft")
_PREPARED: dict[tuple, Path] = {}


def scores(root, run_id: str, key: str = "critic/score/mean") -> list[float]:
    """The values of metric `key` of MLflow run `run_id` (in root/mlflow.db), step by step."""
    from mlflow.tracking import MlflowClient

    history = MlflowClient(f"sqlite:///{root}/mlflow.db").get_metric_history(run_id, key)
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def run_dir(out) -> Path | None:
    """The run directory a training in output directory `out` writes (runs/<id>); None before there is one."""
    found = sorted((Path(out) / "runs").glob("*"))
    return found[-1] if found else None


def latest_checkpoint(out) -> str | None:
    """The name `latest` gives in the run directory of `out` (iter_NNNNNN), or None."""
    found = run_dir(out)
    pointer = found / "checkpoints" / "latest" if found else None
    return pointer.read_text().strip() if pointer is not None and pointer.is_file() else None


from tests.flows.local import local_root  # noqa: E402, F401 (a fixture: data and MLflow for in-process runs)
