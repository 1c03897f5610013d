"""8. Two nightly runs started together: one trains, the other exits saying why. The one that trains is
then SIGKILLed mid-training, and the next nightly resumes its run instead of starting over, taking the
finished data stages from the persisted results (their bodies do not run again)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.flows.conftest import latest_checkpoint, run_dir, small_overrides

pytestmark = pytest.mark.slow


def test_two_nightlies_one_trains_and_a_crashed_one_is_resumed(tmp_path, prefect_api):
    # an output directory named like the pipeline: the nightly's lock and its training's are still two locks
    ov = small_overrides(tmp_path, iterations=4) + [
        "trainer.save_interval=1",
        f"trainer.output_dir={tmp_path}/nightly",
    ]
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db",
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

    params = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(run_id).data.params
    assert params["trainer.log_system_metrics"] == "True"


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
