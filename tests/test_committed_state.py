"""What a commit holds is current: dvc.lock records this code, these params and commands, and the metrics files
it names. A fresh clone's `dvc status` reports only the outputs it has not made yet (deleted, not in cache),
never a changed dependency, parameter, command or metric: otherwise `make run` would dirty git at once, and
`dvc metrics diff` or `dvc plots diff` against HEAD would compare against results nobody can reproduce."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DVC = str(Path(sys.executable).parent / "dvc")


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory) -> Path:
    """The tracked files as a fresh clone has them (the working tree's: uncommitted edits count), no outputs."""
    copy = tmp_path_factory.mktemp("committed")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (copy / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, copy / f)
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    return copy


def stage_outputs(root: Path, pipeline: str) -> set[str]:
    """What the pipeline's stages make, as paths relative to the repository (as `dvc status` names them)."""
    file = root / pipeline
    outs = set()
    for stage in yaml.safe_load(file.read_text())["stages"].values():
        wdir = file.parent / stage.get("wdir", ".")
        for entry in stage.get("outs", []) + stage.get("metrics", []):
            path = next(iter(entry)) if isinstance(entry, dict) else entry
            outs.add((wdir / path).resolve().relative_to(root.resolve()).as_posix())
    return outs


PIPELINES = ["dvc.yaml", "vlm/dvc.yaml", "environments/dvc.yaml", "distill/dvc.yaml"]


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_dvc_lock_records_this_code_config_and_metrics(fresh_copy, pipeline):
    res = subprocess.run(
        [DVC, "status", "--json", pipeline], cwd=fresh_copy, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    # what any pipeline makes: a fresh clone lacks them all (distill/dvc.yaml starts from dvc.yaml's outputs)
    made = set().union(*(stage_outputs(fresh_copy, p) for p in PIPELINES))
    stale = []
    for stage, changes in json.loads(res.stdout or "{}").items():
        for change in changes:
            if not isinstance(change, dict) or set(change) - {"changed deps", "changed outs"}:
                stale.append((stage, change))  # a changed command or params, or a stage missing from the lock
                continue
            for path, what in change.get("changed deps", {}).items():
                if what != "deleted" or not any(path == o or path.startswith(o + "/") for o in made):
                    stale.append((stage, path, what))
            for path, what in change.get("changed outs", {}).items():
                if what not in ("deleted", "not in cache"):
                    stale.append((stage, path, what))
    assert not stale, (
        f"{pipeline}'s lock file is not this checkout's: {stale}. Run the pipeline "
        f"(`dvc repro {pipeline}`) and commit its dvc.lock and metrics file."
    )


def test_the_committed_environments_figures_are_the_ones_the_readme_claims():
    """Issue 52's bar, on the figures `make run-envs` commits (the test above ties them to this code and
    config): each reasoning-gym task gains at least 15 points of held-out greedy accuracy, and the README's row
    quotes them."""
    figures = json.loads((ROOT / "metrics/rg_eval.json").read_text())
    tasks = [k for k in figures["gain"] if k.startswith("reasoning_gym_")]
    assert len(tasks) >= 2
    assert {t: figures["gain"][t] >= 0.15 for t in tasks} == dict.fromkeys(tasks, True), figures["gain"]
    readme = (ROOT / "README.md").read_text()
    for task in tasks:
        source = task.removesuffix("/acc")
        before, after = (figures[when]["by_source"][source]["acc"] for when in ("sft", "final"))
        name = source.removeprefix("reasoning_gym_")
        assert f"{name} {before:.3f} -> {after:.3f}" in readme, name


def test_the_committed_game_figures_rise_and_are_the_ones_the_readme_claims():
    """The TextArena game's held-out games won by greedy play rise from SFT to GRPO (metrics/game_eval.json,
    tied to this code and config above), and the README's row quotes them."""
    figures = json.loads((ROOT / "metrics/game_eval.json").read_text())
    before, after = figures["sft"]["acc"], figures["final"]["acc"]
    assert after > before and figures["final"]["n"] == 100
    assert f"{before:.2f} -> {after:.2f} of 100 games" in (ROOT / "README.md").read_text()


def test_the_committed_distillation_figures_meet_the_bar_and_are_the_ones_the_readme_claims():
    """Issue 53's bar, on the figures `make run-distill` commits (tied to this code and config above): the
    distilled student closes at least half the held-out accuracy gap between its start and its teacher (the
    default pipeline's GRPO model) in its 50 iterations, and beats the same student trained by GRPO alone."""
    distilled = json.loads((ROOT / "metrics/distill_eval.json").read_text())
    alone = json.loads((ROOT / "metrics/student_grpo_eval.json").read_text())
    teacher = json.loads((ROOT / "metrics/eval.json").read_text())["final"]["acc"]
    start, after = distilled["sft"]["acc"], distilled["final"]["acc"]
    assert distilled["iterations"] == alone["iterations"] == 50
    assert alone["sft"]["acc"] == start  # the same student, from the same SFT model
    assert after - start >= (teacher - start) / 2, (start, after, teacher)
    assert after > alone["final"]["acc"]
    closed = round(100 * (after - start) / (teacher - start))
    row = (
        f"{start:.3f} -> {after:.2f} ({closed} % of the gap to the teacher closed); the same student by GRPO "
    )
    assert row + f"alone {start:.3f} -> {alone['final']['acc']:.2f}" in (ROOT / "README.md").read_text()
