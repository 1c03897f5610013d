"""Output directories: a stage writes, replaces or prunes only what it created itself.

Every output directory reinforge creates holds a marker file naming its kind (an SFT model, a training run's
output, a reward model, ...). Before any work a stage checks its output path: not the project or run
directory itself or one of their parents, not a file, and either absent, empty, or marked as an output of the
same kind. Only such a directory is ever replaced (atomically) or has files removed from it.
"""

from __future__ import annotations

import json
from pathlib import Path

from components.errors import OutputError

MARKER = ".reinforge-output"
PROJECT_ROOT = Path(__file__).resolve().parents[1]

# kinds of output directory
SFT_MODEL, TRAIN_OUTPUT, REWARD_MODEL, MODEL = "sft-model", "train-output", "reward-model", "model"


def marker_kind(path: str | Path) -> str | None:
    """The kind a directory's marker names, or None when it has no (readable) marker."""
    marker = Path(path) / MARKER
    try:
        return json.loads(marker.read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def _protected(run_dir: str | Path | None) -> list[Path]:
    """Directories no output may be, nor be a parent of: the run directory, the working directory and the
    project's own checkout."""
    dirs = [Path.cwd().resolve(), PROJECT_ROOT]
    if run_dir is not None:
        dirs.append(Path(run_dir).resolve())
    return list(dict.fromkeys(dirs))


def check_output(path: str | Path, key: str, kind: str, run_dir: str | Path | None = None) -> Path:
    """`path` as an output directory of `kind` that is ours to write: OutputError naming `key` and the fix
    when it is the project, the run directory or a parent of one, a file, or an existing non-empty directory
    that is not a previous output of this kind. Nothing is created."""
    p = Path(path)
    resolved = p.resolve()
    for protected in _protected(run_dir):
        if resolved == protected or resolved in protected.parents:
            what = "is" if resolved == protected else "holds"
            raise OutputError(
                f"{key}={path}: that {what} the directory {protected} (the project or the run "
                "directory); writing an output there would replace it. Give a subdirectory of its "
                f"own, e.g. {key}={Path(path) / 'out'}."
            )
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        raise OutputError(
            f"{key}={path}: it is a file or a link, not a directory reinforge made; give a path of its own."
        )
    if p.is_dir() and any(p.iterdir()) and marker_kind(p) != kind:
        found = marker_kind(p)
        what = f"a {found} output" if found else "files reinforge did not write"
        raise OutputError(
            f"{key}={path}: the directory holds {what}, so it is not replaced or written into. "
            "Give an empty or new directory, or move those files away."
        )
    return p


def claim_output(path: str | Path, key: str, kind: str, run_dir: str | Path | None = None) -> Path:
    """check_output, then create the directory (if needed) with its marker; returns it."""
    p = check_output(path, key, kind, run_dir)
    p.mkdir(parents=True, exist_ok=True)
    if marker_kind(p) != kind:
        write_marker(p, kind)
    return p


def write_marker(directory: str | Path, kind: str) -> None:
    # the kind alone: the same output written twice is the same bytes (DVC records its hash in dvc.lock)
    (Path(directory) / MARKER).write_text(json.dumps({"kind": kind}) + "\n")
