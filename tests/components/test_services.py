"""The Prefect server `reinforge` starts for its run (components/services.py) never outlives the run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

START = (
    "from components.services import own_prefect_server, start_prefect_server_early\n"
    "start_prefect_server_early()\n"
    "print(own_prefect_server(), flush=True)\n"
    "import time; time.sleep(120)\n"
)


def test_the_runs_prefect_server_stops_when_the_run_is_sigkilled():
    """SIGKILL skips atexit: the server is told by the kernel (PR_SET_PDEATHSIG) that its parent died."""
    run = subprocess.Popen([sys.executable, "-c", START], stdout=subprocess.PIPE, text=True)
    server = psutil.Process(int(run.stdout.readline()))
    assert "uvicorn" in " ".join(server.cmdline())
    run.send_signal(signal.SIGKILL)
    run.wait(10)
    deadline = time.time() + 30
    while time.time() < deadline and server.is_running() and server.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.1)
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE


def test_a_corrupt_or_locked_tracking_store_is_one_line(tmp_path, monkeypatch):
    """The embedded MLflow store (mlruns.db) that is not a database, or that another process holds locked, stops
    the command before anything starts, naming the file and the fix (it was a traceback)."""
    import sqlite3

    from components.errors import ServiceError
    from components.services import check_services

    store = tmp_path / "mlruns.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    store.write_bytes(b"\x00not a database" * 100)
    with pytest.raises(ServiceError, match=r"mlruns.db is not a readable SQLite database .* move it aside"):
        check_services(1.0)
    store.unlink()
    holder = sqlite3.connect(store)
    holder.execute("CREATE TABLE t (x)")
    holder.commit()
    holder.execute("BEGIN EXCLUSIVE")  # another process's long write
    try:
        with pytest.raises(ServiceError, match=r"mlruns.db is locked by another process for more than 1 s"):
            check_services(1.0)
    finally:
        holder.rollback()
        holder.close()
    check_services(1.0)  # released: fine again
