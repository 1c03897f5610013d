"""Deployments on a real Prefect server (README's block itself runs as written in tests/docs/test_doc_runs.py):
`reinforge deploy` serves the pipelines, `prefect deployment run` triggers one, and Prefect's own `prefect
deploy --all` reads prefect.yaml; and production's shape: a work pool's worker runs deployments cloned from
git, one at a time.

A training deployment runs again with its own defaults (each run trains a new run: trainer.when_finished=retrain
is in its parameters), and a run that fails on a user's error says so in one line of its logs, no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.flows.conftest import poll, sft_ready

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def flow_run_of(client, deployment: str, parameters: dict | None = None):
    """Trigger `deployment` as `prefect deployment run` does; its flow run id."""
    d = client.read_deployment_by_name(deployment)
    return client.create_flow_run_from_deployment(d.id, parameters=parameters or {}).id


def prefect_deployment_run(deployment: str, env: dict):
    """`prefect deployment run <deployment>`, as a user types it; the id of the flow run it created."""
    import re
    from uuid import UUID

    res = subprocess.run(
        [str(BIN / "prefect"), "deployment", "run", deployment], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return UUID(re.search(r"UUID: ([0-9a-f-]{36})", res.stdout).group(1))


def final_state(client, run_id, timeout_s: float = 600.0):
    run = poll(lambda: client.read_flow_run(run_id), lambda r: r.state.is_final(), timeout_s)
    return run.state


def logs_of(client, run_id) -> list:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    return client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))


@pytest.fixture(scope="module")
def served(tmp_path_factory, prefect_api):
    """A small training pipeline served by `reinforge deploy` (a process of its own, as in the README)."""
    root = tmp_path_factory.mktemp("deploy")
    with sft_ready(root) as ov:
        pipelines = root / "pipelines.yaml"
        pipelines.write_text(
            yaml.safe_dump(
                {
                    "pipelines": [
                        {
                            "name": "small",
                            "version": "0.1.0",
                            "flow": "train",
                            "config": "configs/arith_grpo.yaml",
                            "parameters": {"overrides": ov},
                        }
                    ]
                }
            )
        )
        env = {**os.environ, "PREFECT_API_URL": prefect_api, "MLFLOW_TRACKING_URI": f"sqlite:///{root}/m.db"}
        env["PREFECT_RUNNER_POLL_FREQUENCY"] = "2"  # the runner looks for scheduled runs every 2 s, not 10
        proc = subprocess.Popen(
            [str(BIN / "reinforge"), "deploy", "--file", str(pipelines)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            from prefect import get_client

            with get_client(sync_client=True) as client:
                found = poll(lambda: _deployment(client, "rl-train/small"), lambda d: d is not None, 120)
                assert found is not None, "reinforge deploy registered no deployment"
                yield client, root, proc
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def _deployment(client, name):
    from prefect.exceptions import ObjectNotFound

    try:
        return client.read_deployment_by_name(name)
    except ObjectNotFound:
        return None


def test_overlapping_runs_of_a_deployment_and_a_shorter_one_after_them_each_train_a_run_of_their_own(served):
    """Two `prefect deployment run`s of one deployment at once, then one asking for fewer iterations than the
    runs before it trained, as a user types them: none waits on or is refused for another's run directory."""
    client, root, _ = served
    env = {**os.environ, "PREFECT_API_URL": str(client.api_url).rstrip("/")}
    before = set((root / "grpo" / "runs").glob("*")) if (root / "grpo" / "runs").is_dir() else set()
    both = [prefect_deployment_run("rl-train/small", env) for _ in range(2)]
    states = [final_state(client, run_id) for run_id in both]
    assert [s.type.value for s in states] == ["COMPLETED"] * 2, [s.message for s in states]
    made = set((root / "grpo" / "runs").iterdir()) - before
    assert len(made) == 2, made  # a run directory each
    overrides = client.read_deployment_by_name("rl-train/small").parameters["overrides"]
    shorter = json.dumps({"overrides": [*overrides, "trainer.iterations=1"]})
    res = subprocess.run(
        [str(BIN / "prefect"), "deployment", "run", "rl-train/small", "--params", shorter],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    import re
    from uuid import UUID

    run_id = UUID(re.search(r"UUID: ([0-9a-f-]{36})", res.stdout).group(1))
    state = final_state(client, run_id)
    assert state.type.value == "COMPLETED", state.message


def test_a_failed_run_says_why_in_one_line(served):
    client, _, proc = served
    bad = client.read_deployment_by_name("rl-train/small").parameters["overrides"] + ["algorithm.betta=0.1"]
    run_id = flow_run_of(client, "rl-train/small", {"overrides": bad})
    assert final_state(client, run_id).type.value == "FAILED"
    logs = poll(lambda: logs_of(client, run_id), lambda ls: any(x.level >= 40 for x in ls), 60)
    errors = [x.message for x in logs if x.level >= 40]
    assert len(errors) == 1 and errors[0].startswith("error: invalid config"), errors
    assert "algorithm.betta: unknown key. Did you mean `algorithm.beta`?" in errors[0]
    assert not any("Traceback" in x.message for x in logs)
    assert not any(x.message.startswith("Finished in state Completed(") for x in logs if "task" in x.name)


def test_prefect_deploy_reads_prefect_yaml(prefect_api):
    """Prefect's own convention: a process work pool and `prefect deploy --all` from the checkout register the
    same deployments, parameters and schedule that `reinforge deploy` does."""
    from prefect import get_client

    from flows.deploy import load_pipelines, parameters_of

    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    before = (ROOT / "prefect.yaml").read_bytes()
    for cmd in (
        ["work-pool", "create", "reinforge", "--type", "process", "--overwrite"],
        ["--no-prompt", "deploy", "--all"],
    ):
        res = subprocess.run([str(BIN / "prefect"), *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert (ROOT / "prefect.yaml").read_bytes() == before  # deploying never rewrites the file
    with get_client(sync_client=True) as client:
        for p in load_pipelines():
            flow = {"train": "rl-train", "nightly": "rl-nightly"}[p.flow]
            d = client.read_deployment_by_name(f"{flow}/{p.name}")
            assert d.parameters == parameters_of(p) and d.work_pool_name == "reinforge"
            assert d.version == p.version and [s.schedule.cron for s in d.schedules] == (
                [p.schedule.cron] if p.schedule else []
            )
            limit = d.global_concurrency_limit.limit if d.global_concurrency_limit else None
            assert limit == p.concurrency_limit  # the nightly's 1: two never train at once


def test_a_work_pools_worker_runs_a_deployment_cloned_from_git_one_run_at_a_time(tmp_path, prefect_api):
    """Production's shape: a process work pool, `reinforge deploy --work-pool --source <git URL>` (code a worker
    on another machine could clone, not a path of this one), and `prefect worker start` in another directory.
    Two runs of a pipeline limited to one at a time (the nightly's concurrency_limit: 1): never both running,
    both completed by the worker from its clone."""
    import time

    from prefect import get_client

    bare = tmp_path / "reinforge.git"  # the committed code, as a git server holds it
    res = subprocess.run(
        ["git", "clone", "-q", "--bare", str(ROOT), str(bare)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    with sft_ready(tmp_path / "data") as ov:
        pipeline = {
            "name": "from-git",
            "version": "0.1.0",
            "flow": "train",
            "config": "configs/arith_grpo.yaml",
            "concurrency_limit": 1,
            "parameters": {"overrides": ov},
        }
        (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": [pipeline]}))
        env = {**os.environ, "PREFECT_API_URL": prefect_api}
        for cmd in (
            [str(BIN / "prefect"), "work-pool", "create", "gitpool", "--type", "process", "--overwrite"],
            [str(BIN / "reinforge"), "deploy", "--file", str(tmp_path / "pipelines.yaml")]
            + ["--work-pool", "gitpool", "--source", f"file://{bare}"],
        ):
            res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        with get_client(sync_client=True) as client:
            d = client.read_deployment_by_name("rl-train/from-git")
            assert any(f"file://{bare}" in json.dumps(step) for step in d.pull_steps or []), (
                d.pull_steps
            )  # a git_clone pull step, not a set_working_directory of this machine
            # both are asked for before the worker starts, so its first poll finds two runs for one slot: one
            # must wait however fast the other trains (a run that ends before the second is asked for proves
            # nothing about the limit)
            ids = [prefect_deployment_run("rl-train/from-git", env) for _ in range(2)]
            worker = subprocess.Popen(
                [str(BIN / "prefect"), "worker", "start", "--pool", "gitpool"],
                cwd=tmp_path,  # not the checkout: the flow runs from the worker's clone
                env=env | {"PREFECT_WORKER_QUERY_SECONDS": "2"},  # it asks for runs every 2 s, not 10
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                deadline = time.time() + 600
                while time.time() < deadline and not all(
                    client.read_flow_run(i).state.is_final() for i in ids
                ):
                    time.sleep(0.5)
                runs = [client.read_flow_run(i) for i in ids]
                waited = [[st.name for st in client.read_flow_run_states(i)] for i in ids]
            finally:
                os.killpg(worker.pid, signal.SIGTERM)
                try:
                    worker.wait(60)
                except subprocess.TimeoutExpired:  # a loaded machine: its shutdown outlasted its grace
                    os.killpg(worker.pid, signal.SIGKILL)
                    worker.wait(60)
    assert [r.state.type.value for r in runs] == ["COMPLETED", "COMPLETED"], [r.state.message for r in runs]
    assert all(r.work_pool_name == "gitpool" for r in runs)
    # with the deployment's own defaults (trainer.when_finished=retrain), the second trained a new run beside
    # the first, from the start, and each is one finished MLflow run
    from mlflow.tracking import MlflowClient

    assert len(list((tmp_path / "data" / "grpo" / "runs").iterdir())) == 2
    store = MlflowClient(f"sqlite:///{tmp_path}/data/mlflow.db")
    mlflow_runs = store.search_runs([store.get_experiment_by_name("e2e").experiment_id])
    assert [r.info.status for r in mlflow_runs] == ["FINISHED", "FINISHED"]
    first, second = sorted(runs, key=lambda r: r.start_time)
    assert first.end_time <= second.start_time, runs  # never both at once
    assert sum("AwaitingConcurrencySlot" in names for names in waited) == 1, waited  # one waited its turn
