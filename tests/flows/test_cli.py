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
            "x": [1],
            "fingerprint_config": {f"k{i}": i for i in range(50)},  # data, behind --json
        }
    )
    lines = [line.split() for line in text.splitlines()]
    assert lines[0][0] == "created" and lines[0][1].startswith("2026-12-")  # a date, in the local timezone
    assert ["sft.acc", "0.3"] in lines and ["final.acc", "0.6049"] in lines and ["iterations", "100"] in lines
    assert not any(line[0] == "x" or line[0].startswith("fingerprint_config") for line in lines)


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


@pytest.mark.parametrize("command", ["train", "nightly"])
def test_a_held_lock_is_answered_before_prefect_or_ray_starts(tmp_path, monkeypatch, capsys, command):
    from components.locking import exclusive, pipeline_lock, training_lock
    from flows.cli import main

    _no_services(monkeypatch)
    out = tmp_path / "grpo"
    args = [command, "--config", "configs/arith_grpo.yaml", *paths_under(tmp_path, out)]
    locks = [training_lock(out)] + ([pipeline_lock(out)] if command == "nightly" else [])
    for lock in locks:
        with exclusive(lock, "the other run"):
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
