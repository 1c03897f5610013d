"""The `reinforge` command line: every subcommand answers --help with its own program name, at once (without
importing Prefect, Ray, MLflow or torch), and rejects an option it does not take before any work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flows.parsers import COMMANDS

HEAVY = ("torch", "prefect", "ray", "mlflow", "transformers")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_has_its_own_help(name, capsys):
    from flows.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith(f"usage: reinforge {name} "), out[:80]
    assert COMMANDS[name][0]().description.split()[0] in out


def test_help_imports_none_of_the_heavy_libraries():
    # the modules a --help loads, read in a fresh interpreter (this one has them all loaded already)
    code = (
        "import sys, contextlib, io\n"
        "from flows.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['train', '--help'])\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


def test_steps_do_not_take_the_step_option(capsys):
    from flows.cli import main

    for name in ("prepare", "clean"):
        with pytest.raises(SystemExit) as exit_:
            main([name, "--step", "clean"])
        assert exit_.value.code == 2
        assert "unrecognized arguments: --step" in capsys.readouterr().err


def test_version_is_the_installed_distributions(capsys):
    from flows.cli import main
    from reinforge import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"reinforge {__version__}\n" and __version__ != "0+unknown"


def test_a_stages_summary_shows_nested_figures_and_dates_not_epochs():
    from flows._args import summary

    text = summary(
        {
            "created": 1796456800.0,
            "iterations": 100,
            "sft": {"acc": 0.3},
            "final": {"acc": 0.6049},
            "x": list(range(50)),  # data, behind --json
            "fingerprint_config": {f"k{i}": i for i in range(50)},
            "prepare": ["data/raw/train.parquet", "data/raw/test.parquet"],  # what the data stages made
            "clean": [{"kept": 9, "quarantined": 1, "reasons": {"empty": 1}}],
        }
    )
    lines = [line.split() for line in text.splitlines()]
    assert lines[0][0] == "created" and lines[0][1].startswith("2026-12-")  # a date, in the local timezone
    assert ["sft.acc", "0.3"] in lines and ["final.acc", "0.6049"] in lines and ["iterations", "100"] in lines
    assert not any(line[0] == "x" or line[0].startswith("fingerprint_config") for line in lines)
    assert ["prepare", "data/raw/train.parquet,", "data/raw/test.parquet"] in lines
    assert ["clean[0].kept", "9"] in lines and ["clean[0].reasons.empty", "1"] in lines


def paths_under(root, out) -> list[str]:
    """A small run's overrides with every path under `root` and its training output in `out`."""
    from tests.flows.conftest import small_overrides

    kept = [o for o in small_overrides(root) if not o.startswith("trainer.output_dir=")]
    return [*kept, f"trainer.output_dir={out}"]


def _no_services(monkeypatch):
    """Prefect's server and Ray fail the test if anything starts them."""
    from components import services
    from components.training import cluster

    def started(*args, **kwargs):
        raise AssertionError("a service started before the output directory was checked")

    monkeypatch.setattr(services, "start_prefect_server_early", started)
    monkeypatch.setattr(cluster, "ensure_ray", started)


def test_a_held_pipeline_lock_is_answered_before_prefect_or_ray_starts(tmp_path, monkeypatch, capsys):
    from components.locking import exclusive, pipeline_lock
    from flows.cli import main

    _no_services(monkeypatch)
    out = tmp_path / "grpo"
    args = ["nightly", "--config", "configs/arith_grpo.yaml", *paths_under(tmp_path, out)]
    with exclusive(pipeline_lock(out), "the other run"):
        assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is already running (pid" in err, err


def test_a_foreign_output_directory_is_answered_before_prefect_or_ray_starts(tmp_path, monkeypatch, capsys):
    from flows.cli import main

    _no_services(monkeypatch)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not reinforge's")
    assert main(["train", "--config", "configs/arith_grpo.yaml", *paths_under(tmp_path, out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"error: trainer.output_dir={out}: the directory holds files reinforge did not write"
    )


@pytest.mark.parametrize("command", ["evaluate", "train"])
def test_ctrl_c_in_the_first_seconds_is_one_line_and_leaves_nothing(tmp_path, command):
    """Ctrl-C while the command still imports and starts its services (before its flow runs) stops it like
    Ctrl-C mid-run: one line, exit 130, no traceback, nothing of its process group left."""
    import os
    import signal
    import time

    for delay in (0.3, 1.0, 2.0):
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", command, "--config", "configs/arith_grpo.yaml"]
            + paths_under(tmp_path, tmp_path / "grpo"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a process group, as a terminal's job is: Ctrl-C goes to all of it
        )
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "Traceback" not in output, (delay, output[-2000:])
        assert output.strip().splitlines() == [
            "error: interrupted (SIGINT); every process it started is stopped. Run the same command again."
        ]
        time.sleep(0.5)
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)  # no process of the group is left


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["generate", "--temperature", "-1", "1+1="], "argument --temperature: -1 is outside 0..100"),
        (["generate", "--temperature", "nan", "1+1="], "argument --temperature: nan is outside"),
        (["generate", "--temperature", "inf", "1+1="], "argument --temperature: inf is outside"),
        (
            ["generate", "--max_new_tokens", "100000000000", "1+1="],
            "argument --max_new_tokens: 100000000000 is",
        ),
        (["generate", "--max_new_tokens", "0", "1+1="], "argument --max_new_tokens: 0 is outside 1..65536"),
        (["generate", "-n", "abc", "1+1="], "argument -n: 'abc' is not an integer"),
        (["generate", "--seed", "-3", "1+1="], "argument --seed: -3 is outside"),
        (["reward-model", "--lr", "-0.1"], "argument --lr: -0.1 is outside"),
        (["reward-model", "--steps", "1e9"], "argument --steps: '1e9' is not an integer"),
        (
            ["convert", "--to", "sharded", "--source", "x", "--out", "y", "--tensor-parallel", "0"],
            "--tensor-parallel",
        ),
    ],
)
def test_a_number_out_of_its_range_is_one_line_naming_the_argument(args, named, capsys):
    from flows.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: reinforge {args[0]}: ")
    assert named in err and "usage:" not in err


@pytest.mark.parametrize("command", ["train", "evaluate", "sft", "nightly", "config show"])
@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["actor.optimizer.lr=1e-4", "actor.optimizer.lr=2e-4"],
            "override `actor.optimizer.lr` is given twice",
        ),
        (
            ["trainer.seed=1", "data.batch_size=8", " trainer.seed=2"],
            "override `trainer.seed` is given twice",
        ),
        (
            ["trainer.experiment_name=a\nb"],
            "override `trainer.experiment_name`: its value holds a line break",
        ),
        (["trainer.experiment_name=a\r\nb"], "its value holds a line break"),
    ],
)
def test_a_repeated_key_or_a_line_break_on_the_command_line_is_one_line(command, overrides, named, capsys):
    from flows.cli import main

    assert main([*command.split(), "--config", "configs/arith_grpo.yaml", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and named in err, err


PIPELINE = (
    "pipelines:\n"
    "  - {{name: n, version: '1', flow: nightly, config: {config}, parameters: {{overrides: {ov}}}}}\n"
)


@pytest.mark.parametrize(
    ("config", "overrides", "named"),
    [
        ("../elsewhere.yaml", "[]", "pipelines.0.config: '../elsewhere.yaml' resolves to"),
        ("/etc/hostname", "[]", "outside the project"),
        ("configs/no_such.yaml", "[]", "'configs/no_such.yaml' is not a file in the project"),
        ("configs/arith_grpo.yaml", "'algorithm.beta=0.04'", "is not a list of key=value strings"),
        ("configs/arith_grpo.yaml", "[1, 2]", "is not a list of key=value strings"),
        (
            "configs/arith_grpo.yaml",
            "[trainer.seed=1, trainer.seed=2]",
            "override `trainer.seed` is given twice",
        ),
    ],
)
def test_a_pipelines_file_refuses_a_config_outside_the_project_and_untyped_overrides(
    tmp_path, config, overrides, named
):
    from components.errors import ConfigError
    from flows.deploy import load_pipelines

    f = tmp_path / "pipelines.yaml"
    f.write_text(PIPELINE.format(config=config, ov=overrides))
    with pytest.raises(ConfigError) as err:
        load_pipelines(f)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_evaluate_of_one_model_without_its_data_is_refused_before_any_import(capsys):
    from flows.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["evaluate", "--model_path", "checkpoints/grpo"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and err.count("\n") == 0 and "--model_path needs --eval_data FILE" in err
    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    assert "required with --model_path" in capsys.readouterr().out


def test_an_unknown_preset_knob_is_one_line_in_config_show_as_in_train(capsys):
    """`config show` resolved the preset without the checks `train` runs: a KeyError's traceback, exit 1.
    (Not `train` in this process: it starts the run's Prefect server before it checks the config, and the
    server's address would stay in this worker's environment for the tests after it.)"""
    from flows.cli import main

    assert main(["config", "show", "--config", "configs/arith_grpo.yaml", "algorithm.policy_loss=sapoo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "algorithm.policy_loss=sapoo: unknown policy loss" in err, err
    assert "Traceback" not in err
