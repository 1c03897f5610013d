"""Data and models that this project did not make, as a newcomer brings them: plain-string prompts, a base model
without a chat template, and the careless inputs that must stop with one line (exit 2) before any worker or
MLflow run starts."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from components.models import build_char_tokenizer, build_tiny_model, save_pretrained
from tests.conftest import descendants
from tests.flows.conftest import merged, small_overrides

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "arith_grpo.yaml")


def base_model(path: Path, hidden: int = 32, template: bool = False) -> Path:
    """A tiny Qwen2 saved without a chat template, as most base models come."""
    tok = build_char_tokenizer()
    if not template:
        tok.chat_template = None
    model = build_tiny_model(
        tok, hidden_size=hidden, num_layers=1, num_heads=2, intermediate_size=64, max_positions=64, seed=0
    )
    return save_pretrained(model, tok, path)


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def string_rows(count: int, start: int = 0) -> list[dict]:
    """TRL's standard form: the prompt a plain string; ground truths as ints, as a user's own file has them."""
    return [
        {"data_source": "arith", "prompt": f"{a} + {a % 7} =", "reward_model": {"ground_truth": a + a % 7}}
        for a in range(start, start + count)
    ]


@pytest.fixture()
def user_project(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    base_model(tmp_path / "base")
    jsonl(tmp_path / "train.jsonl", string_rows(24))
    jsonl(tmp_path / "test.jsonl", string_rows(6, start=40))
    return tmp_path


def overrides(root: Path, *extra: str) -> list[str]:
    """The user's project as a run's overrides; its workers in this process (trainer.backend=local) unless
    `extra` says ray (what these tests check is the driver's); a key of `extra` replaces the default's (a
    command line gives each key once)."""
    defaults = [
        "trainer.backend=local",
        f"trainer.run_dir={root}",
        f"data.train_path={root}/train.jsonl",
        f"data.eval_path={root}/test.jsonl",
        f"actor.model.path={root}/base",
        f"trainer.output_dir={root}/out",
        f"data.raw_dir={root}/raw",
        f"data.quarantine_dir={root}/quarantine",
        f"sft.output_dir={root}/sft",
        "data.batch_size=4",
        "engine.n=4",
        "engine.max_new_tokens=4",
        "trainer.iterations=2",
        "trainer.test_interval=2",
        "trainer.save_interval=2",
        "trainer.eval_k=2",
        "trainer.progress=false",
        "trainer.experiment_name=user",
        "reward_model.method=flexible",
        "reward_model.format_score=0.1",
    ]
    return merged(defaults, extra)


def no_runs(root: Path) -> bool:
    db = root / "mlflow.db"
    if not db.is_file():
        return True
    client = MlflowClient(f"sqlite:///{db}")
    return not client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.mark.slow
def test_plain_string_prompts_and_a_base_model_without_template_train_end_to_end(
    user_project, prefect_harness
):
    from flows.train import train_flow

    info = train_flow(CONFIG, overrides(user_project))
    client = MlflowClient(f"sqlite:///{user_project}/mlflow.db")
    run = client.get_run(info["run_id"])
    assert run.info.status == "FINISHED"
    invalid = client.get_metric_history(info["run_id"], "reward/invalid_count")
    assert [m.step for m in invalid] == [1, 2] and all(
        m.value == 0 for m in invalid
    )  # int truths became strings
    assert "val/acc" in run.data.metrics and Path(info["final_model"], "model.safetensors").is_file()


def run_train(argv: list[str], capsys) -> tuple[int, str]:
    from flows.train import main

    rc = main(["--config", CONFIG, *argv])
    return rc, capsys.readouterr().err


def no_reward_model_column(root: Path) -> list[str]:
    return [f"data.train_path={jsonl(root / 'bad.jsonl', [{'data_source': 'arith', 'prompt': '1+1='}])}"]


def empty_prompt_and_no_ground_truth(root: Path) -> list[str]:
    bad = {"data_source": "arith", "prompt": "", "reward_model": {"ground_truth": None}}
    return [f"data.train_path={jsonl(root / 'bad.jsonl', string_rows(2) + [bad])}"]


def model_without_weights(root: Path) -> list[str]:
    (root / "base" / "model.safetensors").unlink()
    return []


def pickle_only_model(root: Path) -> list[str]:
    (root / "base" / "model.safetensors").rename(root / "base" / "pytorch_model.bin")
    return []


def messages_for_a_model_without_template(root: Path) -> list[str]:
    row = {
        "data_source": "arith",
        "prompt": [{"role": "user", "content": "1+1="}],
        "reward_model": {"ground_truth": "2"},
    }
    return [f"data.train_path={jsonl(root / 'msgs.jsonl', [row])}"]


def checkpoint_of_another_size(root: Path) -> list[str]:
    from components.tracking import checkpoints

    tok = build_char_tokenizer()
    wider = build_tiny_model(
        tok, hidden_size=48, num_layers=1, num_heads=2, intermediate_size=64, max_positions=64, seed=0
    )
    ckpt = checkpoints.save_checkpoint(
        root / "ckpts",
        1,
        lambda out: save_pretrained(wider, tok, out / "model"),
        {"fingerprint": "another run"},
    )
    return [
        f"trainer.resume_mode={ckpt}",
        "trainer.resume_accept_mismatch=true",
    ]  # past the fingerprint check


def a_data_source_no_scorer_takes(root: Path) -> list[str]:
    rows = [{**row, "data_source": "mytask"} for row in string_rows(4)]
    return [f"data.train_path={jsonl(root / 'own.jsonl', rows)}"]


# the case whose workers start on Ray, beside the checks: the run that stops kills them, leaving none
ON_RAY = {"model_without_weights"}

BAD_INPUTS = {
    no_reward_model_column: r"data\.train_path=.*bad\.jsonl: 1 of 1 rows fail validation: row 0, column "
    r"reward_model: missing_column",
    empty_prompt_and_no_ground_truth: r"row 2, column prompt: empty",
    model_without_weights: r"actor\.model\.path=.*base: config\.json is there but no weights",
    pickle_only_model: r"actor\.model\.path=.*: its weights are only in pickle format \(pytorch_model\.bin\)",
    messages_for_a_model_without_template: r"data\.apply_chat_template: the tokenizer of .*base has no chat "
    r"template, but the prompts of .*msgs\.jsonl are chat messages",
    a_data_source_no_scorer_takes: r"data_source='mytask': no reward scorer registered; .* Map it with "
    r"reward_model\.sources\.mytask=<scorer>",
    checkpoint_of_another_size: r"iter_000001: its model differs in shape from actor\.model\.path=.*base "
    r"\(hidden_size 48 vs 32",
}


@pytest.mark.parametrize("make", list(BAD_INPUTS), ids=lambda f: f.__name__)
def test_bad_input_stops_with_one_line_before_any_run(user_project, prefect_harness, capsys, make):
    backend = "ray" if make.__name__ in ON_RAY else "local"
    rc, err = run_train(overrides(user_project, f"trainer.backend={backend}", *make(user_project)), capsys)
    assert rc == 2, err
    assert re.search(BAD_INPUTS[make], err), err
    assert "Traceback" not in err and err.count("error:") == 1
    assert no_runs(user_project) and not (user_project / "out").exists()
    # the workers that started beside the checks were killed, not waited for: none is left
    from tests.flows.conftest import poll

    left = poll(
        lambda: descendants("ray::ColocatedWorker") + descendants("ray::RewardScorer"), lambda x: not x, 30
    )
    assert not left, left


def test_config_mistakes_stop_before_any_flow(tmp_path, capsys):
    from flows.train import main

    assert main(["actor.model.max_seq_len=4", "data.max_prompt_len=1"]) == 2
    assert "actor.model.max_seq_len=4 is shorter than" in capsys.readouterr().err
    bad = tmp_path / "c.yaml"
    bad.write_bytes(b"trainer:\n  seed: 1\ntrainer:\n  iterations: 2\n")
    assert main(["--config", str(bad)]) == 2
    assert f"{bad}: key `trainer` is set twice (line 1 and line 3)" in capsys.readouterr().err
    bad.write_bytes(b"trainer:\n  seed: \xff\n")
    assert main(["--config", str(bad)]) == 2
    assert f"{bad}: line 2, column 9: byte 0xff is not UTF-8" in capsys.readouterr().err
    assert main(["data.operations=["]) == 2
    assert "override `data.operations=[`: the value is not valid YAML" in capsys.readouterr().err


def test_a_full_disk_during_data_prep_names_the_file(tmp_path, prefect_harness, monkeypatch, capsys):
    import pyarrow.parquet as pq

    from flows.data import main

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "write_table", full)
    rc = main(["--step", "prepare", *small_overrides(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot write {tmp_path}/raw/train.parquet: No space left on device (errno 28)" in err
    assert "Traceback" not in err and not list((tmp_path / "raw").glob("*"))


def test_an_all_invalid_dataset_names_the_quarantine_file_it_wrote(tmp_path, prefect_harness, capsys):
    from components.data.formats import ROW_SCHEMA, make_row
    from components.data.io import write_parquet
    from flows.data import main

    raw = tmp_path / "raw"  # small_overrides' data paths
    write_parquet([make_row("arith", "", "#### 1", "1", "train", 0)], raw / "train.parquet", ROW_SCHEMA)
    write_parquet([make_row("arith", "1+1=", "#### 2", "2", "test", 0)], raw / "test.parquet", ROW_SCHEMA)
    stale = tmp_path / "clean" / "train.parquet"
    stale.parent.mkdir()
    stale.write_text("yesterday's clean file")
    rc = main(["--step", "clean", *merged(small_overrides(tmp_path), [f"data.quarantine_dir={tmp_path}/q"])])
    err = capsys.readouterr().err
    assert rc == 2 and f"written to {tmp_path}/q/train.parquet" in err and "row 0: prompt is empty" in err
    assert (tmp_path / "q" / "train.parquet").is_file() and not stale.exists()


@pytest.mark.slow
def test_the_cli_prints_one_line_and_no_prefect_traceback(user_project, prefect_api):
    """As a user runs it: a real process, Prefect's own failure reporting included."""
    jsonl(user_project / "bad.jsonl", [{"data_source": "arith", "prompt": "1+1="}])
    argv = overrides(user_project, f"data.train_path={user_project}/bad.jsonl")
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    res = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stderr.count("missing_column") == 1, res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--debug", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 2 and "Traceback" in res.stderr


def test_sft_needs_an_answer_per_row_that_fits_the_model(user_project, prefect_harness, capsys):
    from flows.sft import main

    argv = overrides(user_project, "sft.steps=1", "sft.hidden_size=16", "sft.num_heads=2")
    assert main(["--config", CONFIG, *argv]) == 2
    assert (
        "rows have no answer to train on (column extra_info.answer), the first: row 0"
        in capsys.readouterr().err
    )
    rows = [{**r, "extra_info": {"answer": "#### " + "9" * 60}} for r in string_rows(3)]
    jsonl(user_project / "train.jsonl", rows)
    assert main(["--config", CONFIG, *argv]) == 2
    err = capsys.readouterr().err
    assert "3 rows are longer than actor.model.max_seq_len=64 tokens (prompt + answer)" in err, err
    assert not (user_project / "sft").exists()


# ---- rewards that cannot be trained on stop the run; services that do not answer stop it at once ---------------


def _reward_file(root: Path, body: str) -> str:
    (root / "rewards").mkdir(exist_ok=True)
    (root / "rewards" / "mine.py").write_text(
        f"import time\n\ndef compute_score(text, truth, extra):\n    {body}\n"
    )
    return "custom_reward_function.path=rewards/mine.py"


@pytest.mark.slow
def test_a_bool_returning_reward_stops_the_run_at_iteration_one(
    user_project, prefect_harness, capsys, monkeypatch
):
    monkeypatch.chdir(user_project)  # a custom reward file lives inside the project
    rc, err = run_train(
        overrides(user_project, _reward_file(user_project, "return text.strip() == truth")), capsys
    )
    assert rc == 2 and "returned bool False for sample 0" in err and "compute_score" in err, err
    assert "Traceback" not in err
    client = MlflowClient(f"sqlite:///{user_project}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED" and not client.get_metric_history(run.info.run_id, "actor/pg_loss")


@pytest.mark.slow
def test_a_sleeping_reward_is_killed_at_the_stage_timeout_with_no_process_left(
    user_project, prefect_harness, ray_local, capsys, monkeypatch
):
    import time

    monkeypatch.chdir(user_project)
    start = time.monotonic()
    rc, err = run_train(
        overrides(
            user_project,
            _reward_file(user_project, "time.sleep(600)"),
            "trainer.stage_timeout_s=5",
            "trainer.backend=ray",  # the scorer's process killed with everything it started
        ),
        capsys,
    )
    assert rc == 2 and "did not finish within trainer.stage_timeout_s=5 s" in err, err
    assert time.monotonic() - start < 60
    left = descendants("RewardScorer")
    assert not left


def test_a_custom_reward_outside_the_project_is_refused_at_config_validation(tmp_path, capsys, monkeypatch):
    from flows.train import main

    project = tmp_path / "project"
    project.mkdir()
    (tmp_path / "outside.py").write_text("def compute_score(a, b, c):\n    return 1.0\n")
    (project / "two.py").write_text("def compute_score(text, truth):\n    return 1.0\n")
    monkeypatch.chdir(project)
    assert main(["--config", CONFIG, f"custom_reward_function.path={tmp_path}/outside.py"]) == 2
    assert "outside the project" in capsys.readouterr().err
    assert main(["--config", CONFIG, "custom_reward_function.path=two.py"]) == 2
    assert (
        "compute_score(text, truth), but a reward function is called as compute_score(response_text, "
        "ground_truth, extra_info)" in capsys.readouterr().err
    )


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "variable,value,message",
    [
        ("RAY_ADDRESS", "127.0.0.1:{port}", "no Ray cluster answers there"),
        ("MLFLOW_TRACKING_URI", "http://127.0.0.1:{port}", "no MLflow server answers there"),
        ("PREFECT_API_URL", "http://127.0.0.1:{port}/api", "no Prefect API answers there"),
    ],
)
def test_an_unreachable_service_is_one_line_within_the_timeout(capsys, monkeypatch, variable, value, message):
    import time

    from flows.train import main

    address = value.format(port=_closed_port())
    monkeypatch.setenv(variable, address)
    start = time.monotonic()
    assert main(["--config", CONFIG, "trainer.connect_timeout_s=3"]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - start < 3 + 2
    assert err.startswith(f"error: {variable}={address}: {message}") and err.count("\n") == 1, err


def test_a_real_prefect_api_passes_the_check_that_tells_it_from_other_http_servers(prefect_api):
    from components.services import prefect_problem

    assert prefect_problem(prefect_api, 10.0) is None


def test_a_ray_cluster_is_not_asked_for_when_the_workers_run_in_this_process(monkeypatch):
    from flows._args import check_config

    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_closed_port()}")
    assert check_config(CONFIG, ["trainer.backend=local", "trainer.connect_timeout_s=3"]) == 0


@pytest.mark.slow
def test_a_run_that_rewards_nothing_says_so_after_its_first_iterations(user_project, prefect_api):
    """A reward that is 0 for every sample (here a custom one; in life, truths the scorer never matches or
    answers without its form) trains on: after its first 3 iterations the run says so in one line."""
    argv = overrides(user_project, _reward_file(user_project, "return 0.0"), "trainer.iterations=3")
    res = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--config", CONFIG, *argv],
        cwd=user_project,  # a custom reward file lives inside the project
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PREFECT_API_URL": prefect_api},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if "every sample's reward was exactly 0" in line]
    assert len(lines) == 1 and "iterations 1-3" in lines[0] and "rewards/mine.py" in lines[0], res.stderr[
        -3000:
    ]
