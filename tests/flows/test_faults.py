"""Faults injected for real into the training flow: SIGKILL and resume, disk full during a save, a rollout
worker killed mid-iteration. The pass criteria are the brief's "nothing lost" (shared/reference/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from components.errors import OutputError
from components.models.loading import load_model
from components.tracking import checkpoints
from tests.conftest import descendants
from tests.flows.conftest import latest_checkpoint, merged, run_dir, sft_ready

pytestmark = pytest.mark.slow

ITERATIONS = 4
# the faults of Prefect's server and of the disk are the driver's to handle: their runs need no Ray
LOCAL = "trainer.backend=local"


@pytest.fixture(scope="module")
def start(tmp_path_factory, prefect_harness, ray_local):
    root = tmp_path_factory.mktemp("faults")
    with sft_ready(root, ITERATIONS, ("trainer.save_interval=1",), backend="ray") as ov:
        yield root, ov


@pytest.fixture(scope="module")
def whole(start):
    """The uninterrupted run every faulted run must end equal to."""
    from flows.train import train_flow

    root, ov = start
    return train_flow("configs/arith_grpo.yaml", ov + [f"trainer.output_dir={root}/whole"])


def _same_final_model(a: dict, b: dict) -> bool:
    ma, mb = load_model(a["final_model"]).state_dict(), load_model(b["final_model"]).state_dict()
    return ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def _kill_when(proc: subprocess.Popen, out: Path, name: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if latest_checkpoint(out) == name:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"the run ended before {name} ({proc.returncode}): {proc.stdout.read()[-3000:]}"
            )
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no {name} within {timeout} s")


def test_sigkilled_run_resumes_to_the_same_state(start, whole, prefect_api):
    """1. killed at iteration k, resumed with resume_mode=auto: same parameters, optimizer, RNG and sampler as an
    uninterrupted run; one MLflow run whose steps are exactly 1..N once each."""
    from flows.train import train_flow

    root, ov = start
    out = root / "killed"
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",  # `reinforge train`
        "train",
        "--config",
        "configs/arith_grpo.yaml",
        *merged(ov, [f"trainer.output_dir={out}"]),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_API_URL": prefect_api}  # the tests' one server
    proc = subprocess.Popen(
        cmd,
        cwd=os.getcwd(),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _kill_when(proc, out, "iter_000002")
    killed_run = json.loads((run_dir(out) / "checkpoints" / "iter_000002" / "state.json").read_text())[
        "mlflow_run_id"
    ]
    resumed = train_flow("configs/arith_grpo.yaml", ov + [f"trainer.output_dir={out}"])

    assert _same_final_model(whole, resumed)
    last_a, last_b = (run_dir(p) / "checkpoints" / f"iter_{ITERATIONS:06d}" for p in (root / "whole", out))
    for name in ("optimizer.safetensors", "worker.safetensors"):  # optimizer moments and torch RNG state
        ta, tb = load_file(last_a / name), load_file(last_b / name)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
    wa, wb = (json.loads((p / "worker.json").read_text()) for p in (last_a, last_b))
    assert wa == wb  # scheduler, python/numpy RNG, step counters, weights version
    sa, sb = (json.loads((p / "state.json").read_text()) for p in (last_a, last_b))
    assert sa["sampler"] == sb["sampler"] and sa["weights_version"] == sb["weights_version"] == ITERATIONS

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    assert resumed["run_id"] == killed_run
    run = client.get_run(killed_run)
    assert run.info.status == "FINISHED"
    # (the killed run's process was started for it: it also logged its start-up, timing_s/startup/*)
    logged = {k for k in run.data.metrics if not k.startswith("timing_s/startup/")}
    assert logged == client.get_run(whole["run_id"]).data.metrics.keys()
    assert {k for k in run.data.metrics if k not in logged} == {
        f"timing_s/startup/{p}" for p in ("imports", "prefect", "setup", "workers", "first_gen")
    }
    for key in logged:  # each metric at exactly the steps of the uninterrupted run, once each
        steps = sorted(m.step for m in client.get_metric_history(killed_run, key))
        assert steps == sorted(m.step for m in client.get_metric_history(whole["run_id"], key)), key
    steps = sorted(m.step for m in client.get_metric_history(killed_run, "critic/score/mean"))
    assert steps == list(range(1, ITERATIONS + 1))


def test_disk_full_during_a_save_fails_the_run_and_keeps_the_previous_checkpoint(start, monkeypatch):
    """4. ENOSPC while checkpoint 2 is written: checkpoint 1 and the pointer intact, the flow run Failed."""
    from flows.train import train_flow

    root, ov = start
    real = checkpoints._fsync_tree
    calls = {"n": 0}

    def full_disk(path):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(path)

    monkeypatch.setattr(checkpoints, "_fsync_tree", full_disk)
    # the save is the driver's and the policy worker's: the same whether that worker is Ray's or in this process
    out = [f"trainer.output_dir={root}/full", LOCAL]
    state = train_flow("configs/arith_grpo.yaml", ov + out, return_state=True)
    assert state.is_failed(), state
    with pytest.raises(OutputError) as err:  # one line naming the directory and the room it needed
        state.result()
    message = str(err.value)
    assert "\n" not in message and "no space left on the device of" in message and "full" in message
    assert "writing checkpoint iter_000002" in message and "`latest` still names iter_000001" in message
    assert "a checkpoint of this run takes about" in message
    ckroot = run_dir(root / "full") / "checkpoints"
    assert (ckroot / "latest").read_text().strip() == "iter_000001"
    checkpoints.verify(ckroot / "iter_000001")
    assert not (ckroot / "iter_000002").exists() and not list(ckroot.glob(".tmp_*"))


def _pids(title: str) -> list[int]:
    """Ray actor processes of this test's own local cluster (descendants of this process) by title."""
    return [p.pid for p in descendants(title)]


def test_rollout_and_policy_workers_killed_mid_run(start, whole, monkeypatch):
    """5. the rollout actor SIGKILLed during iteration 2, the policy actor during iteration 3: Ray restarts the
    rollout actor and it gets the current weights before it samples; the policy group is rebuilt from the last
    checkpoint; every iteration's samples are scored once; the run ends equal to the uninterrupted one."""
    import threading

    import components.rl as rl
    from flows.train import train_flow

    root, ov = start
    out = root / "workers_killed"
    scored: list[int] = []
    real_score = rl.score_responses

    def counting(batch, *a, **kw):
        scored.append(batch.meta["iteration"])
        return real_score(batch, *a, **kw)

    monkeypatch.setattr("tasks.rl.score_responses", counting)
    killed: dict[str, int] = {}

    def killer():
        for name, after, title in (
            ("rollout", "iter_000001", "ray::RolloutWorker"),
            ("policy", "iter_000002", "ray::PolicyWorker"),
        ):
            deadline = time.time() + 300
            while time.time() < deadline and latest_checkpoint(out) != after:
                time.sleep(0.02)
            pids = _pids(title)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed[name] = len(pids)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    # a rollout actor of its own (the uninterrupted run samples in its policy worker: the same samples)
    info = train_flow(
        "configs/arith_grpo.yaml", ov + [f"trainer.output_dir={out}", "trainer.rollout_placement=separate"]
    )
    thread.join(30)
    assert killed == {"rollout": 1, "policy": 1}, killed
    assert sorted(scored) == list(range(1, ITERATIONS + 1))  # each iteration's samples scored exactly once
    assert _same_final_model(whole, info)


def test_two_engines_with_health_checks_survive_one_killed(start):
    """7. engine.num_engines=2 with health checks: one engine SIGKILLed after iteration 1 is restarted (by Ray, or
    by the health check), gets the current weights, and the run completes with the restart logged as
    rollout/engine_restarts."""
    import threading

    from flows.train import train_flow

    root, ov = start
    out = root / "engine_killed"
    killed: list[int] = []

    def killer():
        deadline = time.time() + 300
        while time.time() < deadline and latest_checkpoint(out) != "iter_000001":
            time.sleep(0.02)
        pids = _pids("ray::RolloutWorker") or _pids("ray::Slow")
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    info = train_flow(
        "configs/arith_grpo.yaml",
        ov
        + [
            f"trainer.output_dir={out}",
            "trainer.rollout_placement=separate",
            "engine.num_engines=2",
            "engine.health_check=true",
            "trainer.iterations=3",
        ],
    )
    thread.join(30)
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    restarts = client.get_metric_history(info["run_id"], "rollout/engine_restarts")
    assert killed and sorted(m.step for m in restarts) == [1, 2, 3]
    assert sum(m.value for m in restarts) >= 1 and info["iterations"] == 3


def _tree(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


def _left(procs: list) -> list:
    import psutil

    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            continue
    return alive


def _train_until(ov: list[str], out: Path, checkpoint: str, prefect_api: str | None, *more: str):
    """`reinforge train` in a process group of its own, once it has saved `checkpoint` (or ended): with
    prefect_api, against that server; without, on its own in-process server."""
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", "configs/arith_grpo.yaml"]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PYTHONUNBUFFERED": "1"} | ({"PREFECT_API_URL": prefect_api} if prefect_api else {})
    proc = subprocess.Popen(
        [*cmd, *merged(ov, [f"trainer.output_dir={out}"], more)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while time.time() < deadline and latest_checkpoint(out) != checkpoint and proc.poll() is None:
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_the_run_at_once_leaving_nothing_and_a_resume_is_exact(start, whole, prefect_api, sig):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM to the process: it exits
    within 15 s with one line saying how to resume, every process it started (Ray, workers) is gone, its
    MLflow run is KILLED, its last checkpoint verifies, and the resumed run ends equal to the uninterrupted one."""
    from flows.train import train_flow

    root, ov = start
    out = root / f"signalled_{sig.name}"
    proc = _train_until(ov, out, "iter_000002", prefect_api)
    tree = _tree(proc.pid)
    assert descendants("ray::", proc.pid)  # its Ray workers are running
    sent = time.time()
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    output, _ = proc.communicate(timeout=60)
    assert time.time() - sent < 15 and proc.returncode == 128 + sig, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"error: interrupted ({sig.name}) at iteration") and "run the same command" in last
    assert "Traceback" not in output
    assert not _left(tree), _left(tree)
    run_id = json.loads((run_dir(out) / "checkpoints" / "iter_000002" / "state.json").read_text())[
        "mlflow_run_id"
    ]
    assert MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(run_id).info.status == "KILLED"
    ckpt = run_dir(out) / "checkpoints"
    checkpoints.verify(ckpt / (ckpt / "latest").read_text().strip())  # what the signal left is whole
    if sig == signal.SIGINT:  # the resume itself is the same for both signals: run it once (suite time)
        resumed = train_flow("configs/arith_grpo.yaml", ov + [f"trainer.output_dir={out}"])
        assert resumed["run_id"] == run_id and _same_final_model(whole, resumed)


def test_a_dead_prefect_server_stops_the_run_within_one_stage(start):
    """The in-process Prefect server dies mid-run: the run stops at the next iteration boundary with a message,
    its checkpoint intact, nothing left running (it used to train on blind, then drain events for hours)."""
    root, ov = start
    out = root / "prefect_died"
    proc = _train_until(ov, out, "iter_000001", None, LOCAL)  # its own in-process server
    tree = _tree(proc.pid)
    assert not descendants("raylet", proc.pid)  # trainer.backend=local: mid-run, and no Ray was started
    (server,) = descendants("uvicorn", proc.pid, recursive=False)
    server.kill()
    killed = time.time()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, output[-3000:]
    assert f"error: Prefect's in-process API server (pid {server.pid}) has died at iteration" in output
    assert "run the same command to resume" in output
    assert time.time() - killed < 60 and not _left(tree)
    ckpt = run_dir(out) / "checkpoints"
    checkpoints.verify(ckpt / (ckpt / "latest").read_text().strip())


def test_a_state_another_client_sets_stops_the_run(start, prefect_api):
    """Another client (the UI, someone holding the API) marks the training flow run Cancelled while it trains:
    the run notices at the next iteration boundary and stops (exit 2, one line), its MLflow run KILLED, instead
    of training on and reporting success."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled

    root, ov = start
    out = root / "cancelled_elsewhere"
    proc = _train_until(ov, out, "iter_000001", prefect_api, "trainer.iterations=200", LOCAL)
    running = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["rl-train"])), flow_run_filter=running
        )
        # this test's run among those earlier tests SIGKILLed (Prefect keeps those Running): its output dir
        (flow_run,) = [r for r in runs if f"trainer.output_dir={out}" in r.parameters.get("overrides", [])]
        client.set_flow_run_state(flow_run.id, Cancelled(), force=True)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, output[-3000:]
    assert f"error: the flow run {flow_run.name} was set to Cancelled by another client" in output
    run_id = json.loads((run_dir(out) / "checkpoints" / "iter_000001" / "state.json").read_text())[
        "mlflow_run_id"
    ]
    assert MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(run_id).info.status == "KILLED"


def _failed_runs() -> set[str]:
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("e2e")
    if experiment is None:
        return set()
    return {
        r.info.run_id for r in client.search_runs(experiment.experiment_id, "attributes.status = 'FAILED'")
    }


def test_an_absurd_learning_rate_stops_the_run_in_one_line_before_any_checkpoint(start):
    """`reinforge train` with a finite but absurd learning rate (its first step leaves weights whose forward is
    NaN): exit 2, one line naming the iteration and actor.optimizer.lr, no traceback; nothing checkpointed, no
    final model, its MLflow run FAILED."""
    root, ov = start
    out, failed = root / "diverged", _failed_runs()
    proc = _train_until(ov, out, "never", None, LOCAL, "actor.optimizer.lr=1e20", "trainer.save_interval=1")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert "Traceback" not in output and last.startswith("error: iteration 1: the actor update diverged"), (
        last
    )
    assert "actor.optimizer.lr (now 1e+20)" in last
    assert not list((run_dir(out) / "checkpoints").glob("iter_*")) and not list(out.rglob("final"))
    assert len(_failed_runs() - failed) == 1


def test_weights_gone_bad_mid_run_stop_it_and_the_last_good_checkpoint_stays_latest(start, monkeypatch):
    """A weight turns NaN before the third update (a fault injected into the policy worker in this process):
    the run fails at iteration 3, checkpoints 1 and 2 verify, `latest` names iteration 2, and nothing of 3 or
    after is written."""
    from components.errors import TrainingDiverged
    from components.training.actor import PolicyTrainer
    from flows.train import train_flow

    root, ov = start
    real = PolicyTrainer.update

    def poisoned(self, batch):
        if self.steps == 2:
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("nan")
        return real(self, batch)

    monkeypatch.setattr(PolicyTrainer, "update", poisoned)
    failed = _failed_runs()
    out = [f"trainer.output_dir={root}/poisoned", LOCAL, "trainer.save_interval=1"]
    state = train_flow("configs/arith_grpo.yaml", ov + out, return_state=True)
    assert state.is_failed(), state
    with pytest.raises(TrainingDiverged, match=r"^iteration 3: the actor update diverged"):
        state.result()
    ckroot = run_dir(root / "poisoned") / "checkpoints"
    assert sorted(p.name for p in ckroot.glob("iter_*")) == ["iter_000001", "iter_000002"]
    assert (ckroot / "latest").read_text().strip() == "iter_000002"
    checkpoints.verify(ckroot / "iter_000002")
    assert not list((root / "poisoned").rglob("final"))
    assert len(_failed_runs() - failed) == 1
