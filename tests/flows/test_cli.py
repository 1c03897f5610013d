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
