"""The command blocks of README.md and docs/*.md, as a user copies them.

Each fenced shell or Python block is preceded by a marker saying how it is run:

    <!-- doc-test: tests/docs/test_doc_runs.py::test_name -->   that test takes the block and runs it as written
    <!-- doc-test: skip: reason -->                              a GPU, or a service of the user's own

A block with no marker, or a marker naming a test that does not exist or does not take its block, fails the
first test: a new block can not be added unchecked. The tests here run theirs from this checkout (blocks
that only read it, or write what they clean up); tests/docs/test_doc_runs.py runs the pipeline's in a
checkout of its own. Placeholders (`<your-dir>`) are replaced, and no variable the doc does not set is.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.docs.blocks import (
    ROOT,
    all_blocks,
    as_script,
    command_blocks,
    marked,
    marker_problem,
    run_block,
    user_env,
)


def test_every_command_block_says_how_it_is_checked():
    blocks = all_blocks()
    assert len(blocks) >= 15, [b.where() for b in blocks]  # the fence pattern finds the blocks
    problems = [f"{b.where()}: {why}" for b in blocks if (why := marker_problem(b))]
    assert not problems, "\n".join(problems)


def test_the_marker_check_catches_a_missing_or_wrong_marker(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nls\n```\n\n<!-- doc-test: tests/nowhere.py::test_x -->\n```bash\nls\n```\n\n"
        "<!-- doc-test: skip: needs a GPU -->\n```sh\nnvidia-smi\n```\n"
    )
    a, b, c = command_blocks(page)
    assert "no <!-- doc-test" in marker_problem(a) and "does not exist" in marker_problem(b)
    assert marker_problem(c) is None and c.body == "nvidia-smi\n"


@pytest.mark.slow
def test_the_mlflow_ui_as_the_readme_starts_it():
    """README's `reinforge ui`: MLflow's UI on the checkout's store; the link it prints answers, and opens the
    runs table (the model-training view)."""
    import signal
    import urllib.request

    proc = subprocess.Popen(
        ["bash", "-c", as_script(marked("test_the_mlflow_ui_as_the_readme_starts_it"))],
        cwd=ROOT,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        said = []  # MLflow's server says a few lines first; the link comes once the UI answers
        while not (said and said[-1].startswith("MLflow UI: ")) and (line := proc.stdout.readline()):
            said.append(line)
        assert said and said[-1].startswith("MLflow UI: http://"), "".join(said) + proc.stderr.read()[-2000:]
        link = said[-1].split(": ", 1)[1].strip()
        assert link.endswith("?workflowType=machine_learning")
        with urllib.request.urlopen(link.split("#")[0], timeout=30) as page:
            assert page.status == 200 and b"<html" in page.read(2000).lower()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)


@pytest.mark.slow
def test_install_and_verify_as_docs_cli_md_writes_it():
    """docs/cli.md's check of an install: the version, the sanity tests, `reinforge diagnose` with and without
    a config, each exiting 0 from the checkout with nothing set."""
    res = run_block(as_script(marked("test_install_and_verify_as_docs_cli_md_writes_it")), 600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from reinforge import __version__

    assert (
        res.stdout.startswith(f"{__version__}\n")
        and " passed" in res.stdout
        and "Traceback" not in res.stderr
    )
