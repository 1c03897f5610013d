"""DVC in a temp git repo: repro runs every stage, a second repro does nothing, a param change re-runs
only what reads it, and `dvc metrics show` prints the accuracies."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.flows.conftest import small_overrides

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def sh(cmd: list[str], cwd: Path, env: dict) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


def set_keys(cfg: dict, overrides: list[str]) -> None:
    for item in overrides:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)


@pytest.fixture(scope="module")
def repo(tmp_path_factory, prefect_api):
    repo = tmp_path_factory.mktemp("dvc_repo")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for f in files + [".dvc/config", ".dvc/.gitignore", ".dvcignore", "dvc.yaml"]:
        if (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    cfg_path = repo / "configs" / "arith_grpo.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    local = [o for o in small_overrides(".") if not o.split("=")[0].endswith(("_dir", "_path", ".path"))]
    set_keys(cfg, local)
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "MLFLOW_TRACKING_URI": f"sqlite:///{repo}/m.db",
           "PYTHONPATH": str(repo)}
    env["PREFECT_API_URL"] = prefect_api  # the stages report to one server instead of starting one each
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init"]):
        sh(cmd, repo, env)
    return repo, env


def test_repro_all_then_nothing_then_only_dependents(repo):
    repo, env = repo
    first = sh(["dvc", "repro"], repo, env)
    for stage in ("prepare", "clean", "sft", "train", "evaluate"):
        assert f"Running stage '{stage}'" in first
    metrics = sh(["dvc", "metrics", "show"], repo, env)
    assert "sft.acc" in metrics and "final.acc" in metrics

    second = sh(["dvc", "repro"], repo, env)
    assert "Running stage" not in second
    assert "up to date" in sh(["dvc", "status"], repo, env)
    # a changed training parameter re-runs only train and evaluate: test_repro_killed_mid_training_... below


def test_repro_killed_mid_training_resumes_and_ends_clean(repo):
    """9. A changed training parameter, and `dvc repro` SIGKILLed inside the train stage, then run again: it
    completes from the checkpoints that survived (the stage's output persists), only the stages that read the
    parameter run (train, evaluate; not prepare, clean, sft), and `dvc status` is clean."""
    import signal
    import time

    repo, env = repo
    cfg_path = repo / "configs" / "arith_grpo.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["algorithm"]["clip_epsilon"] = 0.25  # train must run again
    cfg["trainer"]["save_interval"] = 1
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    ckpts = repo / "checkpoints" / "grpo" / "checkpoints"
    before = {p.name: p.stat().st_mtime for p in ckpts.glob("iter_*")}
    proc = subprocess.Popen(["dvc", "repro"], cwd=repo, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline:  # wait for a checkpoint of the new run, then kill the whole repro
        fresh = [p for p in ckpts.glob("iter_*") if before.get(p.name) != p.stat().st_mtime]
        if fresh:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(60)
    assert fresh, "no checkpoint appeared before the deadline"
    out = sh(["dvc", "repro"], repo, env)
    assert "Running stage 'train'" in out and "Running stage 'evaluate'" in out
    for stage in ("prepare", "clean", "sft"):
        assert f"Running stage '{stage}'" not in out
    assert (ckpts / fresh[0].name).is_dir()  # what the killed run saved survived the second repro
    assert not list(ckpts.glob(".tmp_*"))
    status = sh(["dvc", "status"], repo, env)
    assert "up to date" in status, status


def test_dataset_edited_behind_dvcs_back_stops_training(repo):
    """10. a tracked file changed outside DVC: training refuses to start and names the file."""
    import pyarrow.parquet as pq

    repo, env = repo
    train = repo / "data" / "clean" / "train.parquet"
    table = pq.read_table(train)
    pq.write_table(table.slice(1), train)  # one row fewer, still a valid parquet
    res = subprocess.run([sys.executable, "-m", "flows.train", "--config", "configs/arith_grpo.yaml"], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2  # our error, not a crash: the CLI's last word names the file and the fix
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data/clean/train.parquet was changed outside DVC") and "dvc repro" in last
