"""DVC in a temp git repo (the default pipeline, dvc.yaml, named as the target: `dvc repro` alone would run
vlm/dvc.yaml's multimodal pipeline too): repro runs every stage, a second repro does nothing, a param change re-runs
only what reads it, `dvc metrics show` prints the accuracies, and experiments compare without touching the
workspace's run. The stages run from a shell without the venv activated (scripts/py finds it)."""

from __future__ import annotations

import json
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


def sh(cmd: list[str], cwd: Path, env: dict, stdout_only: bool = False) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout if stdout_only else res.stdout + res.stderr


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
    (repo / ".venv").symlink_to(VENV_BIN.parent)  # the checkout's own venv, as `make install` leaves it
    # no venv on PATH, none activated: dvc is called by its path, the stages find the venv through scripts/py
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        PATH="/usr/local/bin:/usr/bin:/bin",
        MLFLOW_TRACKING_URI=f"sqlite:///{repo}/m.db",
        PREFECT_API_URL=prefect_api,
    )  # the stages report to one server instead of starting one each
    git(repo, env, "init", "-q")
    commit(repo, env, "init")
    return repo, env


DVC = str(VENV_BIN / "dvc")


def git(repo: Path, env: dict, *args: str) -> str:
    return sh(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], repo, env)


def commit(repo: Path, env: dict, message: str) -> None:
    git(repo, env, "add", "-A")
    git(repo, env, "commit", "-qm", message)


def snapshot(root: Path) -> dict[str, str]:
    import hashlib

    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_repro_all_then_nothing_then_only_dependents(repo):
    repo, env = repo
    first = sh([DVC, "repro", "dvc.yaml"], repo, env)
    for stage in ("prepare", "clean", "sft", "train", "evaluate"):
        assert f"Running stage '{stage}'" in first
    metrics = sh([DVC, "metrics", "show"], repo, env)
    assert "sft.acc" in metrics and "final.acc" in metrics
    plots = json.loads(sh([DVC, "plots", "show", "--json", "dvc.yaml"], repo, env, stdout_only=True))["data"]
    reward = plots["reward"][0]["content"]["data"]["values"]
    iterations = yaml.safe_load((repo / "configs" / "arith_grpo.yaml").read_text())["trainer"]["iterations"]
    assert [r["step"] for r in reward] == list(range(1, iterations + 1))
    assert all(0 <= r["reward"] <= 1 for r in reward) and plots["held_out_accuracy"][0]["content"]["data"]

    second = sh([DVC, "repro", "dvc.yaml"], repo, env)
    assert "Running stage" not in second
    assert "up to date" in sh([DVC, "status", "dvc.yaml"], repo, env)
    commit(repo, env, "the pipeline's results")  # dvc.lock and metrics/eval.json, as a user commits them
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
    runs = repo / "checkpoints" / "grpo" / "runs"
    main_run = snapshot(runs)  # the first configuration's run: never touched by another one
    proc = subprocess.Popen(
        [DVC, "repro", "dvc.yaml"],
        cwd=repo,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while time.time() < deadline:  # wait for a checkpoint of the new run, then kill the whole repro
        fresh = [
            p
            for p in runs.glob("*/checkpoints/iter_*")
            if p.relative_to(runs).as_posix() + "/state.json" not in main_run
        ]
        if fresh:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(60)
    assert fresh, "no checkpoint appeared before the deadline"
    out = sh([DVC, "repro", "dvc.yaml"], repo, env)
    assert "Running stage 'train'" in out and "Running stage 'evaluate'" in out
    for stage in ("prepare", "clean", "sft"):
        assert f"Running stage '{stage}'" not in out
    assert fresh[0].is_dir()  # what the killed run saved survived the second repro
    assert not list(fresh[0].parent.glob(".tmp_*"))
    assert {k: v for k, v in snapshot(runs).items() if k in main_run} == main_run
    status = sh([DVC, "status", "dvc.yaml"], repo, env)
    assert "up to date" in status, status
    commit(repo, env, "clip 0.25")


def test_experiments_compare_and_leave_the_workspace_as_it_was(repo):
    """`dvc exp run --temp -S ...` trains the changed configuration beside the workspace's run (never resuming,
    overwriting or deleting it), `dvc exp show` lists both accuracies, `dvc metrics diff` loads HEAD, and a
    failing experiment leaves the config file as it was."""
    import json

    repo, env = repo
    config = (repo / "configs" / "arith_grpo.yaml").read_bytes()
    workspace = snapshot(repo / "checkpoints" / "grpo")
    key = "configs/arith_grpo.yaml:"
    sh(
        [
            DVC,
            "exp",
            "run",
            "--temp",
            "-S",
            f"{key}algorithm.kl_loss_coef=0.04",
            "-S",
            f"{key}trainer.iterations=5",
            "dvc.yaml",
        ],
        repo,
        env,
    )
    shown = json.loads(sh([DVC, "exp", "show", "--json"], repo, env, stdout_only=True))
    accs = []
    for rev in shown:  # the workspace, HEAD with its experiments
        for exp in [rev, *(e for group in rev.get("experiments") or [] for e in group["revs"])]:
            metrics = (
                ((exp.get("data") or {}).get("metrics") or {}).get("metrics/eval.json", {}).get("data", {})
            )
            if "final" in metrics:
                accs.append((metrics["iterations"], metrics["final"]["acc"]))
    assert {it for it, _ in accs} >= {5, 4}, accs  # the experiment (5 iterations) and the workspace's run (4)
    assert "final.acc" in sh([DVC, "metrics", "diff", "--all", "HEAD~1"], repo, env)  # HEAD's metrics load
    res = subprocess.run(
        [DVC, "exp", "run", "--temp", "-S", f"{key}trainer.iterations=1", "dvc.yaml"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode != 0 and "trainer.iterations=1 is fewer than the" in res.stdout + res.stderr
    assert (repo / "configs" / "arith_grpo.yaml").read_bytes() == config  # never rewritten
    assert snapshot(repo / "checkpoints" / "grpo") == workspace


def test_an_edited_reward_function_reruns_training(repo):
    """rewards/ (custom_reward_function.path) is a dependency of train and evaluate: an edit reruns them."""
    repo, env = repo
    (repo / "rewards" / "example.py").write_text(
        (repo / "rewards" / "example.py").read_text() + "\n# edited\n"
    )
    status = sh([DVC, "status", "dvc.yaml"], repo, env)
    assert "train:" in status and "evaluate:" in status and "rewards" in status
    git(repo, env, "checkout", "--", "rewards/example.py")


def test_dataset_edited_behind_dvcs_back_stops_training(repo):
    """10. a tracked file changed outside DVC: training refuses to start and names the file."""
    import pyarrow.parquet as pq

    repo, env = repo
    train = repo / "data" / "clean" / "train.parquet"
    table = pq.read_table(train)
    pq.write_table(table.slice(1), train)  # one row fewer, still a valid parquet
    res = subprocess.run(
        ["scripts/py", "-m", "flows.cli", "train", "--config", "configs/arith_grpo.yaml"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 2  # our error, not a crash: the CLI's last word names the file and the fix
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data/clean/train.parquet was changed outside DVC") and "dvc repro" in last
