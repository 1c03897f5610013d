"""Nothing lost, runs that never lie: outputs never replace what reinforge did not write, one run per output
directory, another configuration's checkpoints are never touched, and a run that would train nothing stops
before writing anything (shared/reference/reliability.md, "Classes a careless or hostile user found")."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from components.locking import exclusive
from tests.flows.conftest import merged, sft_ready

pytestmark = pytest.mark.slow
CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "arith_grpo.yaml")


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (relative names)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prefect_harness):
    """A finished 2-iteration run in root/grpo (checkpoints at 1 and 2)."""
    from flows.train import train_flow

    root = tmp_path_factory.mktemp("outputs")
    with sft_ready(
        root, 2, ("trainer.save_interval=1", "trainer.test_interval=2", "trainer.eval_size=8")
    ) as ov:
        info = train_flow(CONFIG, ov)
        yield root, ov, info


def mlflow_view(root: Path, run_id: str) -> tuple:
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    run = client.get_run(run_id)
    steps = sorted(m.step for m in client.get_metric_history(run_id, "critic/score/mean"))
    return run.info.run_name, run.info.status, run.data.params, steps


def test_a_changed_config_in_the_same_output_dir_never_touches_the_first_run(trained):
    from flows.train import train_flow

    root, ov, info = trained
    first = Path(info["final_model"]).parent
    before = snapshot(first)
    other = train_flow(CONFIG, ov + ["algorithm.clip_epsilon=0.3", "trainer.max_checkpoints_to_keep=1"])
    assert Path(other["final_model"]).parent != first and snapshot(first) == before
    mine = Path(other["final_model"]).parent / "checkpoints"
    assert sorted(p.name for p in mine.glob("iter_*")) == ["iter_000002"]  # pruned its own, not the first's
    assert (mine / "latest").read_text().strip() == "iter_000002"
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    for run_id in (info["run_id"], other["run_id"]):  # each (metric, step) once, in its own run
        assert sorted(m.step for m in client.get_metric_history(run_id, "critic/score/mean")) == [1, 2]


def test_an_edited_custom_reward_starts_a_fresh_run(trained, monkeypatch):
    from flows.train import train_flow

    root, ov, _ = trained
    monkeypatch.chdir(root)  # a custom reward file lives inside the project
    reward = root / "rewards" / "mine.py"
    reward.parent.mkdir()
    reward.write_text("def compute_score(text, truth, extra):\n    return float(truth in text)\n")
    args = ov + ["custom_reward_function.path=rewards/mine.py", "trainer.iterations=1"]
    first = train_flow(CONFIG, args)
    reward.write_text(
        "def compute_score(text, truth, extra):\n    return float(text.strip().endswith(truth))\n"
    )
    second = train_flow(CONFIG, args)  # the same command: not "already finished", a new run from iteration 1
    assert Path(second["final_model"]).parent != Path(first["final_model"]).parent
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    assert [m.step for m in client.get_metric_history(second["run_id"], "critic/score/mean")] == [1]


def test_more_iterations_extend_a_finished_run_and_the_history_says_so(trained):
    from flows.train import train_flow

    root, ov, info = trained
    view = mlflow_view(root, info["run_id"])
    more = train_flow(CONFIG, ov + ["trainer.iterations=3"])
    assert Path(more["final_model"]) == Path(info["final_model"])  # the same run directory, extended
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    child = client.get_run(more["run_id"])
    assert more["run_id"] != info["run_id"] and child.data.tags["mlflow.parentRunId"] == info["run_id"]
    assert child.data.tags["reinforge.extends"] == f"{info['run_id']} at iteration 2"
    assert [m.step for m in client.get_metric_history(more["run_id"], "critic/score/mean")] == [
        3
    ]  # only the extra
    assert mlflow_view(root, info["run_id"]) == view  # the finished run: not renamed, not reopened
    run = json.loads((Path(info["final_model"]).parent / "run.json").read_text())
    assert run["iterations"] == 3 and run["mlflow_runs"] == [info["run_id"], more["run_id"]]
    assert (Path(info["final_model"]).parent / "checkpoints" / "iter_000003").is_dir()


def test_outputs_that_are_not_ours_are_refused_before_any_work(
    tmp_path, prefect_harness, capsys, monkeypatch
):
    """`sft.output_dir=.`, `..`, the run directory itself, and `reward-model --out` onto a directory holding a
    file of the user's: refused before any work, every file still there."""
    from flows.reward_model import main as reward_model
    from flows.sft import main as sft

    project = tmp_path / "project"
    (project / "keep").mkdir(parents=True)
    (project / "keep" / "notes.txt").write_text("my notes")
    (project / "mine").mkdir()
    (project / "mine" / "data.csv").write_text("a,b\n1,2\n")
    monkeypatch.chdir(project)
    before = snapshot(project)
    base = [
        "--config",
        CONFIG,
        f"trainer.run_dir={project}",
        "data.raw_dir=raw",
        "data.quarantine_dir=q",
        "data.train_path=train.parquet",
        "data.eval_path=test.parquet",
        "trainer.output_dir=out",
    ]
    for value, message in (
        (".", "that is the run directory"),
        ("..", "outside the run directory"),
        (str(project), "that is the run directory"),
    ):
        assert sft([*base, f"sft.output_dir={value}"]) == 2
        err = capsys.readouterr().err
        assert f"sft.output_dir={value}" in err and message in err, err
    assert sft([*base, "sft.output_dir=keep"]) == 2  # a directory of the user's own
    assert "sft.output_dir=keep: the directory holds files reinforge did not write" in capsys.readouterr().err
    assert reward_model([*base, "sft.output_dir=sft", "--out", "mine"]) == 2
    assert "--out=mine: the directory holds files reinforge did not write" in capsys.readouterr().err
    assert reward_model([*base, "sft.output_dir=sft", "--out", ".."]) == 2
    assert "--out=..: it resolves outside the run directory" in capsys.readouterr().err
    assert snapshot(project) == before  # every file still there, by content


def test_as_many_iterations_as_a_finished_run_stop_and_fewer_train_a_new_run(trained, capsys):
    """After the extension above (the run finished 3 iterations): asking for 3 again has nothing to train and
    writes nothing; asking for 1 is a run of its own, trained in a new directory, the finished one untouched.
    After the tests that continue the first run: the run it adds is the newest of the configuration."""
    from flows.train import main, train_flow

    root, ov, info = trained
    before, view = snapshot(root / "grpo"), mlflow_view(root, info["run_id"])
    assert main(["--config", CONFIG, *merged(ov, ["trainer.iterations=3"])]) == 2
    err = capsys.readouterr().err
    assert "already finished all 3 iterations" in err and "Traceback" not in err
    assert snapshot(root / "grpo") == before  # run.json, checkpoints, final model: byte-identical
    assert mlflow_view(root, info["run_id"]) == view  # name, status, params, steps unchanged
    first = Path(info["final_model"]).parent
    kept = snapshot(first)
    shorter = train_flow(CONFIG, merged(ov, ["trainer.iterations=1"]))
    assert Path(shorter["final_model"]).parent != first and snapshot(first) == kept


def test_runs_of_one_output_dir_never_block_or_refuse_each_other(trained):
    """While another process trains the finished run (its run directory's lock held), a run asking for more
    iterations trains a run of its own instead of extending the busy one; a shorter retraining (what a
    deployment run or the nightly asks) trains a new run instead of being refused. Last in this module: the
    runs it adds are the newest of the configuration, which the tests above would continue."""
    from components.locking import run_lock
    from flows.train import train_flow

    root, ov, info = trained
    first = Path(info["final_model"]).parent
    before = snapshot(first)
    with exclusive(run_lock(first), "the first training"):
        longer = train_flow(CONFIG, merged(ov, ["trainer.iterations=3"]))
    own = Path(longer["final_model"]).parent
    assert own != first and snapshot(first) == before  # the busy run: not extended, not touched
    assert (own / "checkpoints" / "latest").read_text().strip() == "iter_000003"
    model = MlflowClient(f"sqlite:///{root}/mlflow.db").get_logged_model(longer["model_id"])
    assert model.tags["reinforge.evaluation"].startswith("not evaluated yet")  # and where its figures are
    shorter = train_flow(CONFIG, merged(ov, ["trainer.iterations=1", "trainer.when_finished=retrain"]))
    assert Path(shorter["final_model"]).parent not in (first, own) and snapshot(first) == before
