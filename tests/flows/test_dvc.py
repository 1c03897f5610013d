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

from tests.docs.checkout import set_keys
from tests.flows.conftest import small_overrides

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def sh(cmd: list[str], cwd: Path, env: dict, stdout_only: bool = False) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout if stdout_only else res.stdout + res.stderr


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
    # no MLFLOW_TRACKING_URI: each run logs to the checkout's own store (mlflow.db), as a user's does
    unset = ("VIRTUAL_ENV", "PYTHONPATH", "MLFLOW_TRACKING_URI")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(
        PATH="/usr/local/bin:/usr/bin:/bin", PREFECT_API_URL=prefect_api
    )  # the stages report to one server instead of starting one each
    git(repo, env, "init", "-q")
    commit(repo, env, "init")
    # the project's default remote, moved to a directory of this test's (the user's cache is left alone)
    sh(
        [str(VENV_BIN / "dvc"), "remote", "modify", "--local", "store", "url", str(repo.parent / "store")],
        repo,
        env,
    )
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
    # the pipeline changed nothing in git but its two results (this repository's config is smaller than the
    # committed one): no .gitignore written, no marker or log file left untracked
    changed = git(repo, env, "status", "--porcelain").splitlines()
    assert sorted(changed) == [" M dvc.lock", " M metrics/eval.json"], changed
    commit(repo, env, "the pipeline's results")  # dvc.lock and metrics/eval.json, as a user commits them
    sh([DVC, "push", "dvc.yaml"], repo, env)  # what `make run` does after the repro


def test_a_fresh_clone_pulls_the_outputs_then_reproduces_them_and_stays_clean(repo, tmp_path):
    """A second clone (`make run`'s `dvc repro --pull`) takes the outputs from the remote instead of running the
    stages, and git stays clean; trained again from the same SFT model (`dvc repro -f -s`), the train stage
    writes the same bytes, so git stays clean too (the run directories, MLflow ids and timestamps are not
    DVC outputs)."""
    repo, env = repo
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(repo), str(clone)], tmp_path, env)
    (clone / ".venv").symlink_to(VENV_BIN.parent)
    sh([DVC, "remote", "modify", "--local", "store", "url", str(repo.parent / "store")], clone, env)
    pulled = sh([DVC, "repro", "--pull", "dvc.yaml"], clone, env)
    assert (
        "Running stage" not in pulled and (clone / "checkpoints" / "grpo" / "final" / "config.json").is_file()
    )
    assert git(clone, env, "status", "--porcelain") == ""
    sh([DVC, "repro", "-f", "-s", "dvc.yaml:train"], clone, env)
    assert (clone / "checkpoints" / "grpo" / "runs").is_dir()  # it trained, in a run directory of its own
    assert "Running stage" not in sh([DVC, "repro", "dvc.yaml"], clone, env)  # evaluate's input is unchanged
    assert git(clone, env, "status", "--porcelain") == ""
    # code the train stage reads, edited (a helper beside the reward functions): its configuration's run is
    # finished, and the stage trains a new one instead of refusing (trainer.when_finished=retrain)
    (clone / "rewards" / "helpers.py").write_text("# shared by the reward functions\n")
    edited = sh([DVC, "repro", "dvc.yaml"], clone, env)
    runs = [p for p in (clone / "checkpoints" / "grpo" / "runs").iterdir() if p.is_dir()]
    assert "Running stage 'train'" in edited and len(runs) == 2, edited
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
    # train must run again, and its model differs (clip_epsilon would not: one PPO epoch on one mini-batch never
    # clips), so evaluate, which reads only the final model, runs again too
    cfg["actor"]["optimizer"]["lr"] = 5e-4
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
    assert "Running stage 'train'" in out and "Running stage 'evaluate'" in out, out[-4000:]
    for stage in ("prepare", "clean", "sft"):
        assert f"Running stage '{stage}'" not in out
    assert fresh[0].is_dir()  # what the killed run saved survived the second repro
    assert not list(fresh[0].parent.glob(".tmp_*"))
    assert {k: v for k, v in snapshot(runs).items() if k in main_run} == main_run
    status = sh([DVC, "status", "dvc.yaml"], repo, env)
    assert "up to date" in status, status
    commit(repo, env, "lr 5e-4")


def exp_metrics(repo: Path, env: dict) -> dict[str, dict]:
    """{experiment name (or the workspace's and HEAD's rev): its metrics/eval.json} from `dvc exp show`."""
    shown = json.loads(sh([DVC, "exp", "show", "--json"], repo, env, stdout_only=True))
    out = {}
    for rev in shown:  # the workspace, HEAD with its experiments
        for exp in [rev, *(e for group in rev.get("experiments") or [] for e in group["revs"])]:
            data = exp.get("data") or {}
            metrics = (data.get("metrics") or {}).get("metrics/eval.json", {}).get("data", {})
            if "final" in metrics:
                out[exp.get("name") or data.get("rev") or exp.get("rev")] = metrics
    return out


def mlflow_runs_of_experiment(repo: Path, name: str) -> list:
    """The MLflow runs of the checkout's own store tagged with DVC experiment `name`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    experiment = client.get_experiment_by_name("e2e")
    return client.search_runs([experiment.experiment_id], f"tags.`dvc.exp_name` = '{name}'")


def test_experiments_compare_and_leave_the_workspace_as_it_was(repo):
    """`dvc exp run --temp -S ...` trains the changed configuration beside the workspace's run (never resuming,
    overwriting or deleting it), `dvc exp show` lists both accuracies, `dvc metrics diff` loads HEAD, and a
    failing experiment leaves the config file as it was. The experiment trains in DVC's temporary copy, but its
    MLflow run, metrics and logged model are in the checkout's own store, tagged with the experiment's name and
    baseline commit, so `dvc exp show` and the MLflow UI list the same experiments."""
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
    shown = exp_metrics(repo, env)
    # the experiment (5 iterations) and the workspace's run (4)
    assert {m["iterations"] for m in shown.values()} >= {5, 4}, shown
    (name,) = [n for n, m in shown.items() if m["iterations"] == 5]
    table = sh(
        [DVC, "exp", "show", "--md", "--only-changed"], repo, env, stdout_only=True
    )  # as README has it
    assert name in table and "…" not in table, table
    (run,) = mlflow_runs_of_experiment(repo, name)
    head = git(repo, env, "rev-parse", "HEAD").strip()
    assert run.info.status == "FINISHED" and run.data.tags["dvc.exp_baseline_rev"] == head
    assert (
        run.info.run_name.startswith(f"{name}-grpo-") and run.data.params["algorithm.kl_loss_coef"] == "0.04"
    )
    assert run.data.metrics["eval/final/acc"] == shown[name]["final"]["acc"]  # the same figure in both UIs
    (model,) = run.outputs.model_outputs  # its logged model's files, in the checkout's artifact store
    assert (repo / "mlruns" / "e2e" / "models" / model.model_id / "artifacts" / "MLmodel").is_file()
    assert not list((repo / ".dvc" / "tmp" / "exps").glob("**/tmp*"))  # the temporary copy is gone
    assert "final.acc" in sh([DVC, "metrics", "diff", "--all", "HEAD~1"], repo, env)  # HEAD's metrics load
    sh([DVC, "plots", "diff", "HEAD", name, "--targets", "dvc.yaml"], repo, env)  # README's line, as written
    assert (repo / "dvc_plots" / "index.html").is_file()
    assert "dvc_plots" not in git(repo, env, "status", "--porcelain")  # ignored, as every output here
    res = subprocess.run(  # an experiment that fails (greedy GRPO is refused): the workspace stays as it was
        [DVC, "exp", "run", "--temp", "-S", f"{key}engine.temperature=0", "dvc.yaml"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode != 0 and "engine.temperature=0 samples greedily" in res.stdout + res.stderr
    assert (repo / "configs" / "arith_grpo.yaml").read_bytes() == config  # never rewritten
    assert snapshot(repo / "checkpoints" / "grpo") == workspace


def test_the_readmes_experiment_commands_as_written(repo):
    """README's experiments block, line for line in the checkout's copy (the venv activated where it says so):
    an experiment, a queued one run by the queue, the table, the metrics diff, then the plots of HEAD against
    the first experiment (its name put for `<experiment>`)."""
    from tests.docs.blocks import as_script, marked

    repo, env = repo
    *lines, plots = marked("test_the_readmes_experiment_commands_as_written").body.strip().splitlines()
    before = set(exp_metrics(repo, env))
    res = subprocess.run(
        ["bash", "-c", as_script("\n".join(lines))],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    shown = exp_metrics(repo, env)
    made = {n: m for n, m in shown.items() if n not in before}
    assert len(made) == 2, made  # the --temp one, the queued one
    assert all(name in res.stdout for name in made) and "…" not in res.stdout  # exp show's table, whole
    changed = {}
    for name in made:  # each trained in a copy of its own (the queue's by its worker, started as `dvc` from
        (run,) = mlflow_runs_of_experiment(repo, name)  # the activated venv), logged to the checkout's store
        assert (
            run.info.status == "FINISHED" and run.data.metrics["eval/final/acc"] == made[name]["final"]["acc"]
        )
        params = run.data.params
        changed[name] = (params["algorithm.kl_loss_coef"], float(params["actor.optimizer.lr"]))
    # each experiment's own change reached its run, and only its own
    (first,) = [n for n, (kl, _) in changed.items() if kl == "0.04"]
    (queued,) = [n for n in changed if n != first]
    assert changed[queued][1] == 2e-4 and changed[queued][0] != "0.04", changed
    assert changed[first][1] != 2e-4, changed
    res = subprocess.run(
        ["bash", "-c", as_script(plots, experiment=first)], cwd=repo, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0 and (repo / "dvc_plots" / "index.html").is_file(), res.stderr[-2000:]


def test_an_edited_reward_function_reruns_training(repo):
    """rewards/ (custom_reward_function.path) is a dependency of train and evaluate: an edit reruns them."""
    repo, env = repo
    (repo / "rewards" / "example.py").write_text(
        (repo / "rewards" / "example.py").read_text() + "\n# edited\n"
    )
    status = sh([DVC, "status", "dvc.yaml"], repo, env)
    assert "train:" in status and "evaluate:" in status and "rewards" in status
    git(repo, env, "checkout", "--", "rewards/example.py")


def test_make_clean_leaves_every_tracked_file(repo):
    repo, env = repo
    tracked = git(repo, env, "ls-files").split()
    res = subprocess.run(["make", "clean"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert [f for f in tracked if not (repo / f).exists()] == []
    assert not (repo / "checkpoints").exists() and not (repo / "mlflow.db").exists()  # what the runs wrote
    sh([DVC, "checkout", "dvc.yaml"], repo, env)  # the outputs back from DVC's cache


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
