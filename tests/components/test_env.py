"""Local records and their guards: the embedded Prefect API's auth file fails closed, a local Ray instance's
session is private to its user, and what reinforge writes no other local user can read."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from components.env import AUTH_FILE, prefect_auth_string, read_auth
from components.errors import ConfigError
from tests.conftest import refused_in_one_line

PROJECT = Path(__file__).resolve().parents[2]


def _bad_auth(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / AUTH_FILE
    good = "reinforge:" + "a" * 32 + "\n"
    if kind == "empty":
        path.write_text("")
    elif kind == "blank":
        path.write_text("  \n\n")
    elif kind == "truncated":
        path.write_text("reinforge:abc\n")
    elif kind == "foreign":
        path.write_bytes(b"\x00\xffadmin:admin\n")
    elif kind == "readable by others":
        path.write_text(good)
        path.chmod(0o644)
        return path
    elif kind == "a link":
        (tmp_path / "real").write_text(good)
        (tmp_path / "real").chmod(0o600)
        path.symlink_to(tmp_path / "real")
        return path
    elif kind == "a directory":
        path.mkdir()
        return path
    path.chmod(0o600)
    return path


KINDS = ("empty", "blank", "truncated", "foreign", "readable by others", "a link", "a directory")


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_or_altered_auth_file_is_refused_in_one_line(tmp_path, kind):
    path = _bad_auth(tmp_path, kind)
    with pytest.raises(ConfigError) as err:
        read_auth(path)
    message = str(err.value)
    assert message.startswith(f"{path}, the embedded Prefect API's auth file, ") and "\n" not in message
    assert "Delete it" in message


def test_a_missing_auth_file_is_made_whole_and_private_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    first = prefect_auth_string()
    path = tmp_path / AUTH_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and read_auth(path) == first
    assert prefect_auth_string() == first  # kept
    assert [p.name for p in tmp_path.iterdir()] == [AUTH_FILE]  # no temporary file left


@pytest.mark.parametrize("kind", ["empty", "truncated", "readable by others"])
def test_a_command_refuses_a_bad_auth_file_before_anything_starts(tmp_path, kind):
    """The checkout's auth file (DVC_ROOT names the checkout) is refused by the command in one line; nothing
    runs with the API's auth turned off."""
    _bad_auth(tmp_path, kind)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")}
    env.pop("PREFECT_SERVER_API_AUTH_STRING", None)
    err = refused_in_one_line(
        ["evaluate", "--config", "configs/arith_grpo.yaml"],
        cwd=PROJECT,
        env={**env, "DVC_ROOT": str(tmp_path)},
    )
    assert f"{tmp_path / AUTH_FILE}, the embedded Prefect API's auth file" in err


def test_a_local_ray_instance_keeps_its_session_private_to_its_user(tmp_path):
    """Its logs and runtime resources live under a 0700 directory of this user's, not Ray's shared /tmp/ray."""
    probe = (
        "import os, ray\n"
        "from components.training.cluster import ensure_ray, stop_ray\n"
        "ensure_ray()\n"
        "print(ray._private.worker._global_node.get_session_dir_path())\n"
        "stop_ray()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    res = subprocess.run(
        [sys.executable, "-c", probe], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=300
    )
    session = Path(res.stdout.strip().splitlines()[-1])
    private = session.parent.parent  # Ray's own root (which Ray makes 0777) sits inside it
    assert private.name == f"reinforge-ray-{os.getuid()}" and private.stat().st_uid == os.getuid()
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory another user owns needs root")
def test_a_ray_session_directory_another_user_made_is_refused(tmp_path, monkeypatch):
    import tempfile

    from components.errors import ServiceError
    from components.training import cluster

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    planted = tmp_path / f"reinforge-ray-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, 4242, 4242)
    with pytest.raises(ServiceError, match="is not a directory of this user's; remove it"):
        cluster.private_temp_dir()


def test_what_a_command_writes_no_other_local_user_can_read(tmp_path):
    """The process defaults (every command, stage and worker applies them) keep the user's files private:
    a file and a directory made the ordinary way get no group or other bits."""
    probe = (
        "import flows, os\n"  # applies the defaults, as every command does
        f"os.makedirs({str(tmp_path / 'out' / 'run')!r})\n"
        f"open({str(tmp_path / 'out' / 'run' / 'state.json')!r}, 'w').write('{{}}')\n"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=PROJECT, check=True, timeout=120)
    for p in (tmp_path / "out", tmp_path / "out" / "run", tmp_path / "out" / "run" / "state.json"):
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, (p, oct(p.stat().st_mode))


def test_mlflows_own_default_store_is_ours_and_an_old_store_is_renamed_once(tmp_path, monkeypatch, capsys):
    """MLflow's tools, run in the checkout with no URI, open mlflow.db: the store a run logs to when
    MLFLOW_TRACKING_URI is unset. A checkout whose runs are in the old mlruns.db gets it renamed, once; a set
    URI wins, and nothing is renamed for it."""
    from components.env import adopt_old_store, default_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    mlflow_default = subprocess.run(  # MLflow's own default, asked of MLflow in this directory
        [sys.executable, "-c", "import mlflow; print(mlflow.get_tracking_uri())"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
    ).stdout.strip()
    assert default_tracking_uri(tmp_path) == mlflow_default == f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "mlruns.db").write_bytes(b"runs")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    adopt_old_store(tmp_path)
    assert (tmp_path / "mlruns.db").exists() and default_tracking_uri(tmp_path) == "http://tracking:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    adopt_old_store(tmp_path)
    assert (tmp_path / "mlflow.db").read_bytes() == b"runs" and not (tmp_path / "mlruns.db").exists()
    assert "moved" in capsys.readouterr().err
    (tmp_path / "mlruns.db").write_bytes(b"older")
    adopt_old_store(tmp_path)  # a store of each: neither is touched
    assert (tmp_path / "mlflow.db").read_bytes() == b"runs" and (tmp_path / "mlruns.db").exists()
