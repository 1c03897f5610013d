"""A checkout of the project's own, for running the docs' blocks exactly as written.

The blocks say `.venv/bin/reinforge ...` and write where a user's checkout writes (checkpoints/, mlflow.db,
prefect's deployments of this directory). The venv is an editable install bound to one checkout, so a block
run in a plain copy would run, and write, this one. A scratch checkout therefore gets its own venv: the
checkout's, hard-linked (seconds, no space), with the editable install's path map and the scripts' #! lines
pointed at the copy. Its default config is shrunk to the tests' small pipeline (a user's config; the blocks
are the same), it is a git repository of its own, and its DVC remote is a directory of the test's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv"


# the multi-turn config's data, SFT and run cut to a minute (its task, turns and lengths as they are)
TOOL_SMALL = [
    "data.num_train=64",
    "data.num_eval=8",
    "data.batch_size=4",
    "engine.n=4",
    "sft.steps=40",
    "trainer.iterations=2",
    "trainer.test_interval=2",
    "trainer.save_interval=2",
    "trainer.eval_k=2",
]


def _rewrite(path: Path, old: str, new: str) -> None:
    """Replace `old` in a hard-linked file by writing a new file over the link (the original stays as is)."""
    text = path.read_text()
    if old in text:
        fresh = path.with_name(path.name + ".tmp")
        fresh.write_text(text.replace(old, new))
        shutil.copymode(path, fresh)
        os.replace(fresh, path)


def clone_venv(dest: Path) -> None:
    """`dest/.venv`: this checkout's venv, its packages hard-linked, its reinforge importing from `dest`."""
    subprocess.run(["cp", "-al", str(VENV), str(dest / ".venv")], check=True)
    venv = dest / ".venv"
    for script in (venv / "bin").iterdir():
        if script.is_file() and not script.is_symlink() and script.stat().st_size < 1_000_000:
            try:
                _rewrite(script, str(VENV), str(venv))
            except UnicodeDecodeError:
                pass  # a binary: nothing of this checkout's path in it to move
    (site,) = (venv / "lib").glob("python3*/site-packages")
    for finder in site.glob("__editable__*_finder.py"):
        _rewrite(finder, f"'{ROOT}/", f"'{dest}/")
        for cached in (site / "__pycache__").glob(finder.stem + ".*"):
            cached.unlink()


def set_keys(cfg: dict, overrides: list[str]) -> None:
    """Write `key.path=value` overrides into a loaded config, as a user edits the file."""
    for item in overrides:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)


def shrink(config: Path, overrides: list[str]) -> None:
    cfg = yaml.safe_load(config.read_text())
    set_keys(cfg, overrides)
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))


def scratch_checkout(dest: Path, home: Path) -> Path:
    """The project's files (tracked and new, as the working tree has them) in `dest`, committed to a git
    repository there, with a venv of its own and the default pipeline's data and SFT model made by DVC (as
    the user whose home is `home`)."""
    from tests.docs.blocks import user_env
    from tests.flows.conftest import small_overrides

    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    small = [o for o in small_overrides(".") if not o.split("=")[0].endswith(("_dir", "_path", ".path"))]
    small = [o for o in small if not o.startswith(("trainer.backend=", "trainer.experiment_name="))]
    shrink(dest / "configs" / "arith_grpo.yaml", small)
    shrink(dest / "configs" / "arith_tool_grpo.yaml", TOOL_SMALL)
    clone_venv(dest)
    env = user_env(home)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "a user's checkout"]):
        subprocess.run(git + cmd, cwd=dest, env=env, check=True, capture_output=True)
    dvc = str(dest / ".venv" / "bin" / "dvc")
    store = dest.parent / f"{dest.name}-store"  # the user cache's remote is left alone
    for cmd in (["remote", "modify", "--local", "store", "url", str(store)], ["repro", "dvc.yaml:sft"]):
        res = subprocess.run([dvc, *cmd], cwd=dest, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return dest
