"""The command blocks of README.md and docs/*.md, as a user copies them.

Each fenced shell block is preceded by a marker saying how it is checked:

    <!-- doc-test: tests/docs/test_doc_blocks.py::test_name -->   a test here runs the block as written
    <!-- doc-test: covered: tests/flows/test_x.py -->               that test runs its commands (not verbatim)
    <!-- doc-test: skip: reason -->                                   a GPU, or a service of the user's own

A block with no marker, or a marker naming a test that does not exist, fails the first test: a new block can
not be added unchecked. The blocks a test here runs have their placeholders (`<your-dir>`) replaced and run
through bash from the checkout, with no variable the doc does not set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?:bash|sh|shell|console)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
MARKER = re.compile(r"<!-- doc-test: (?P<how>.+?) -->")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    how: str | None  # the marker's text, None when the block has none
    body: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def command_blocks(path: Path) -> list[Block]:
    """The shell blocks of a markdown file, each with the marker on the line before it (if any)."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        line = text.count("\n", 0, m.start()) + 1
        found.append(Block(path, line, marker["how"].strip() if marker else None, m["body"]))
    return found


def all_blocks() -> list[Block]:
    return [b for path in DOCS for b in command_blocks(path)]


def marked(test: str) -> Block:
    """The one block whose marker names test function `test` (of any test file)."""
    (block,) = [b for b in all_blocks() if (b.how or "").endswith(f"::{test}")]
    return block


def marker_problem(block: Block) -> str | None:
    """Why a block's marker does not say how it is checked; None when it does."""
    if block.how is None:
        return "no <!-- doc-test: ... --> marker on the line before it"
    if block.how.startswith("skip:"):
        return None if block.how[5:].strip() else "a skip marker without its reason"
    target = block.how.removeprefix("covered:").strip()
    file, _, test = target.partition("::")
    if not (ROOT / file).is_file():
        return f"it names {file}, which does not exist"
    if test and f"def {test}(" not in (ROOT / file).read_text():
        return f"it names {target}, which is not a test of that file"
    return None


def test_every_command_block_says_how_it_is_checked():
    blocks = all_blocks()
    assert len(blocks) >= 15, [b.where() for b in blocks]  # the fence pattern finds the blocks
    problems = [f"{b.where()}: {why}" for b in blocks if (why := marker_problem(b))]
    assert not problems, "\n".join(problems)


def test_the_marker_check_catches_a_missing_or_wrong_marker(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nls\n```\n\n<!-- doc-test: covered: tests/nowhere.py -->\n```bash\nls\n```\n\n"
        "<!-- doc-test: skip: needs a GPU -->\n```sh\nnvidia-smi\n```\n"
    )
    a, b, c = command_blocks(page)
    assert "no <!-- doc-test" in marker_problem(a) and "does not exist" in marker_problem(b)
    assert marker_problem(c) is None and c.body == "nvidia-smi\n"


def as_script(block: Block | str, **placeholders: str) -> str:
    """The block (or some of its lines) with each `<name>` placeholder replaced (`your_dir` fills
    `<your-dir>`); every placeholder it has must be given."""
    body = block if isinstance(block, str) else block.body
    for name, value in placeholders.items():
        body = body.replace(f"<{name.replace('_', '-')}>", value)
    left = re.findall(r"<[a-z][a-z-]*>", body)
    assert not left, f"no value for {left} in {body}"
    return "set -euo pipefail\n" + body


def user_env() -> dict[str, str]:
    """A user's shell: HOME, PATH without the venv, the locale; none of the variables the test session set."""
    keep = ("HOME", "USER", "LANG", "LC_ALL", "TMPDIR")
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", **{k: os.environ[k] for k in keep if k in os.environ}}


def run_block(script: str, timeout_s: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=timeout_s
    )


@pytest.mark.slow
def test_your_own_data_as_docs_data_md_writes_it(tmp_path):
    """docs/data.md's own-data block: a user's jsonl of plain-string prompts (one row bad) with a data_source
    of their own, outside the checkout, and a base model of their own without a chat template. `clean`
    quarantines the bad row with its reason, `train` trains on the rest and logs to the checkout's MLflow
    store (mlflow.db, MLflow's own default: mlflow.search_runs finds the run with no URI given)."""
    from tests.flows.test_user_data import base_model, jsonl

    def rows(start: int, count: int) -> list[dict]:
        return [
            {
                "data_source": "mytask",
                "prompt": f"{a} + {a % 7} =",
                "reward_model": {"ground_truth": a + a % 7},
            }
            for a in range(start, start + count)
        ]

    mine = tmp_path / "mine"
    mine.mkdir()
    jsonl(mine / "train.jsonl", rows(0, 24) + [{"data_source": "mytask", "prompt": "", "reward_model": {}}])
    jsonl(mine / "test.jsonl", rows(40, 8))
    base_model(tmp_path / "model")
    made = [ROOT / "data" / "mine", ROOT / "checkpoints" / "mine"]
    try:
        res = run_block(
            as_script(
                marked("test_your_own_data_as_docs_data_md_writes_it"),
                your_dir=str(mine),
                your_model=str(tmp_path / "model"),
            ),
            900,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert "Traceback" not in res.stderr
        import pandas as pd

        kept = pd.read_parquet(ROOT / "data" / "mine" / "train.parquet")
        bad = pd.concat(pd.read_parquet(p) for p in (ROOT / "data" / "mine" / "quarantine").glob("*.parquet"))
        assert len(kept) == 24 and set(bad["reason"]) == {"empty"}, bad[["reason", "detail"]]
        latest = (ROOT / "checkpoints" / "mine" / "latest").read_text().strip()
        final = ROOT / "checkpoints" / "mine" / "runs" / latest / "final"
        assert (final / "model.safetensors").is_file()
        found = subprocess.run(  # MLflow's own tools find the run from the checkout, no URI set
            [
                str(ROOT / ".venv" / "bin" / "python"),
                "-c",
                "import json, mlflow; r = mlflow.search_runs(search_all_experiments=True, "
                "filter_string=\"tags.`reinforge.run_dir` LIKE '%checkpoints/mine%'\"); "
                "print(json.dumps([r['run_id'].tolist(), r['status'].tolist()]))",
            ],
            cwd=ROOT,
            env=user_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        ids, statuses = json.loads(found.stdout.strip().splitlines()[-1])
        assert statuses and set(statuses) == {"FINISHED"}, found.stderr[-2000:]
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        if "ids" in locals():
            from mlflow.tracking import MlflowClient

            client = MlflowClient(f"sqlite:///{ROOT / 'mlflow.db'}")
            for run_id in ids:
                client.delete_run(run_id)  # the checkout's store keeps the user's runs only


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
