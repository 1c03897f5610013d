"""8. Two nightly runs started together: one trains, the other exits saying why. The one that trains is
then SIGKILLed mid-training, and the next nightly resumes its run instead of starting over, taking the
finished data stages from the persisted results (their bodies do not run again). MLflow is a tracking server
(`mlflow server --artifacts-destination`), as in production: the runs, the logged model, the registry and
its alias all go through HTTP, and the artifacts live where the server keeps them (docs/workflows.md)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.flows.conftest import latest_checkpoint, merged, run_dir, small_overrides

pytestmark = pytest.mark.slow


@contextmanager
def mlflow_server(root: Path):
    """`mlflow server` on a free loopback port, its store in `root`, artifacts proxied (clients upload and
    download through it, into root/artifacts); yields its URL, stopped after."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port)]
        + ["--backend-store-uri", f"sqlite:///{root}/server.db", "--workers", "1"]
        + ["--artifacts-destination", str(root / "artifacts")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, "mlflow server did not start"
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def test_two_nightlies_one_trains_and_a_crashed_one_is_resumed(tmp_path, prefect_api):
    with mlflow_server(tmp_path / "mlflow") as tracking:
        two_nightlies(tmp_path, prefect_api, tracking)


def two_nightlies(tmp_path: Path, prefect_api: str, tracking: str) -> None:
    # an output directory named like the pipeline: the nightly's lock and its training's are still two locks
    ov = merged(
        small_overrides(tmp_path, iterations=4),
        ["trainer.save_interval=1", f"trainer.output_dir={tmp_path}/nightly"],
    )
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": tracking,
        "PYTHONUNBUFFERED": "1",
        "PREFECT_API_URL": prefect_api,
    }
    cmd = [sys.executable, "-m", "flows.cli", "nightly", "--config", "configs/arith_grpo.yaml", "--json", *ov]
    procs = [
        subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        for _ in range(2)
    ]
    deadline, loser = time.time() + 600, None
    while time.time() < deadline and latest_checkpoint(tmp_path / "nightly") is None:
        for p in procs:
            if p.poll() is not None and loser is None:
                loser = p
        time.sleep(0.1)
    assert loser is not None, "both nightlies were still running when training had started"
    out, err = loser.communicate(timeout=60)
    assert loser.returncode == 2 and "already running (pid" in err and "exits without training" in err, err
    winner = next(p for p in procs if p is not loser)
    os.killpg(winner.pid, signal.SIGKILL)  # the nightly that trains crashes mid-training
    winner.wait(60)
    ckpts = run_dir(tmp_path / "nightly") / "checkpoints"
    killed_at = (ckpts / "latest").read_text().strip()
    run_id = json.loads((ckpts / killed_at / "state.json").read_text())["mlflow_run_id"]
    data_files = [tmp_path / "raw" / "train.parquet", tmp_path / "clean" / "train.parquet"]
    written = [f.stat().st_mtime_ns for f in data_files]

    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout[res.stdout.index("{") :])
    assert result["train"]["run_id"] == run_id  # the crashed run was continued, not started over
    assert (ckpts / "latest").read_text().strip() == "iter_000004"
    # its model is version 1 of the registered model, the champion, pointing at the logged model (never at files
    # a later nightly could rewrite)
    assert result["registry"]["version"] == "1" and result["registry"]["alias"] == "champion"
    assert result["registry"]["model_id"] == result["train"]["model_id"]
    # the finished data stages came back from Prefect's persisted results: their files were not rewritten
    assert [f.stat().st_mtime_ns for f in data_files] == written
    # the decision is an artifact of the flow run, for the Prefect UI
    assert "reinforge-arith v1: champion" in promotion_artifacts(prefect_api)[0].data
    # the nightly records CPU, memory, disk and network use with its run (trainer.log_system_metrics)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    run = client.get_run(run_id)
    assert run.data.params["trainer.log_system_metrics"] == "True"
    # artifacts went through the server into its destination: no path of the training machine in their URIs
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/"), run.info.artifact_uri
    model = client.get_logged_model(result["registry"]["model_id"])
    assert model.artifact_location.startswith("mlflow-artifacts:/"), model.artifact_location
    stored = tmp_path / "mlflow" / "artifacts"
    assert any(p.name == "model.safetensors" for p in stored.rglob("*")), list(stored.rglob("*"))[:20]
    # the champion, loaded back through HTTP by its alias, answers a prompt
    import mlflow.pyfunc
    import pandas as pd

    # both: the registry URI is a setting of its own, and an earlier test in this process may have set it
    mlflow.set_tracking_uri(tracking)
    mlflow.set_registry_uri(tracking)
    try:
        champion = mlflow.pyfunc.load_model("models:/reinforge-arith@champion")
        out = champion.predict(pd.DataFrame({"prompt": ["2+2="]}), params={"max_new_tokens": 4})
    finally:
        mlflow.set_tracking_uri(None)
        mlflow.set_registry_uri(None)
    assert len(out["completion"]) == 1 and isinstance(out["completion"][0], str)


def promotion_artifacts(api: str) -> list:
    import asyncio

    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read() -> list:
        # the server takes the checkout's auth string (components/env.py), as every client of ours sends it
        async with PrefectClient(api, auth_string=os.environ.get("PREFECT_API_AUTH_STRING")) as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["promotion"]))
            )

    return asyncio.run(read())
