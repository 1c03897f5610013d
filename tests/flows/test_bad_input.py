"""Bad input at the flow level: a clear error naming the key/file, or a quarantine file; no partial output."""

from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from components.data.formats import ROW_SCHEMA, arithmetic_rows
from components.data.io import write_parquet
from components.errors import ConfigError, DataError
from components.validate import load_checked


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)


def test_unknown_config_key_fails_before_any_work(tmp_path):
    res = cli(
        "flows.train",
        "--config",
        "configs/arith_grpo.yaml",
        "algorithm.betta=0.1",
        f"trainer.output_dir={tmp_path}/out",
    )
    assert res.returncode == 2
    assert "algorithm.betta: unknown key. Did you mean `algorithm.beta`?" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()


def test_reinforge_command_help_and_unknown_subcommand(capsys):
    res = cli("flows.cli", "--help")
    assert res.returncode == 0 and "train" in res.stdout and "evaluate" in res.stdout
    res = cli("flows.cli", "trian")
    assert res.returncode == 2 and "unknown command 'trian'" in res.stderr
    from flows.cli import main  # a subcommand's own help, in this process (its modules are loaded already)

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0 and "overrides" in capsys.readouterr().out


def test_missing_data_file_names_it(tmp_path, tokenizer):
    from tasks.data import load_datasets

    cfg = load_checked(
        "configs/arith_grpo.yaml", [f"data.train_path={tmp_path}/missing.parquet", "trainer.run_dir=/"]
    )
    with pytest.raises(DataError, match=r"data\.train_path: .*missing\.parquet does not exist"):
        load_datasets.fn(cfg, tokenizer)


def test_evaluate_missing_model_dir_names_the_key(tmp_path, prefect_harness, capsys):
    from flows.evaluate import main

    assert main(["--model_path", str(tmp_path / "nope"), "--eval_data", "x.parquet"]) == 2
    err = capsys.readouterr().err
    assert "--model_path=" in err and "no Hugging Face model there" in err and "Traceback" not in err


def test_malformed_dataset_is_quarantined_and_clean_output_is_whole(tmp_path):
    from tasks.data import clean_data

    train, test = arithmetic_rows(30, 5, 10, ["+"], 0)
    bad = [
        {**train[0], "prompt": [{"role": "user", "content": ""}]},
        {**train[1], "reward_model": {"style": "rule", "ground_truth": ""}},
        train[2],
    ]
    raw = tmp_path / "raw"
    write_parquet(train + bad, raw / "train.parquet", ROW_SCHEMA)
    write_parquet(test, raw / "test.parquet", ROW_SCHEMA)
    cfg = load_checked(
        "configs/arith_grpo.yaml",
        [
            f"data.raw_dir={raw}",
            f"data.train_path={tmp_path}/c/train.parquet",
            f"data.eval_path={tmp_path}/c/test.parquet",
            f"data.quarantine_dir={tmp_path}/q",
            "trainer.run_dir=/",
        ],
    )
    reports = clean_data.fn(cfg)
    assert (reports[0]["input_rows"], reports[0]["kept"], reports[0]["quarantined"]) == (33, 30, 3)
    q = pq.read_table(tmp_path / "q" / "train.parquet").to_pylist()
    assert sorted((r["reason"], r["column"]) for r in q) == [
        ("duplicate", "prompt"),
        ("empty", "prompt"),
        ("empty", "reward_model.ground_truth"),
    ]
    assert len(pq.read_table(tmp_path / "c" / "train.parquet")) == 30
    assert not list((tmp_path / "c").glob(".*.tmp"))


@pytest.mark.parametrize("key", ["trainer.output_dir", "sft.output_dir", "data.quarantine_dir"])
@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_paths_leaving_the_run_dir_are_rejected_before_any_io(tmp_path, key, how):
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    if how == "dotdot":
        value = f"{run}/../outside/x"
    elif how == "absolute":
        value = str(outside / "x")
    else:
        (run / "link").symlink_to(outside, target_is_directory=True)
        value = f"{run}/link/x"
    import re

    reason = "a symlink leads" if how == "symlink" else "it resolves"
    with pytest.raises(
        ConfigError, match=rf"{re.escape(key)}={re.escape(value)}: {reason} outside the run directory"
    ):
        load_checked("configs/arith_grpo.yaml", [f"trainer.run_dir={run}", f"{key}={value}"])
    assert not list(outside.iterdir())


def test_cli_refuses_an_escaping_path_and_writes_nothing(tmp_path, capsys):
    from flows.data import main

    outside = tmp_path / "outside"
    assert main(["--config", "configs/arith_grpo.yaml", f"data.raw_dir={outside}/raw"]) == 2
    err = capsys.readouterr().err
    assert "data.raw_dir=" in err and "outside the run directory" in err
    assert "Traceback" not in err and not outside.exists()
