"""The deployment quick start, as the README writes it, on a real Prefect server: `reinforge deploy` serves the
pipelines, `prefect deployment run` triggers one, and Prefect's own `prefect deploy --all` reads prefect.yaml.

A training deployment runs again with its own defaults (each run trains a new run: trainer.when_finished=retrain
is in its parameters), and a run that fails on a user's error says so in one line of its logs, no traceback."""

from __future__ import annotations

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


def test_a_training_deployment_runs_twice_with_its_own_defaults(served):
    from mlflow.tracking import MlflowClient

    client, root, _ = served
    states = [final_state(client, flow_run_of(client, "rl-train/small")) for _ in range(2)]
    assert [s.type.value for s in states] == ["COMPLETED", "COMPLETED"], [s.message for s in states]
    runs = sorted(p.name for p in (root / "grpo" / "runs").iterdir())
    assert len(runs) == 2  # the second trained a new run beside the first, from the start
    store = MlflowClient(f"sqlite:///{root}/m.db")
    mlflow_runs = store.search_runs([store.get_experiment_by_name("e2e").experiment_id])
    assert len(mlflow_runs) == 2 and {r.info.status for r in mlflow_runs} == {"FINISHED"}


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
