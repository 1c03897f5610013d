"""components/services.py: the Prefect server `reinforge` starts for its run never outlives the run; what a Ray
cluster's address, token and versions mean for a driver is one line naming the variable and the fix."""

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
    """The embedded MLflow store (mlflow.db) that is not a database, or that another process holds locked, stops
    the command before anything starts, naming the file and the fix (it was a traceback)."""
    import sqlite3

    from components.errors import ServiceError
    from components.services import check_services

    store = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    store.write_bytes(b"\x00not a database" * 100)
    with pytest.raises(ServiceError, match=r"mlflow.db is not a readable SQLite database .* move it aside"):
        check_services(1.0)
    store.unlink()
    holder = sqlite3.connect(store)
    holder.execute("CREATE TABLE t (x)")
    holder.commit()
    holder.execute("BEGIN EXCLUSIVE")  # another process's long write
    try:
        with pytest.raises(ServiceError, match=r"mlflow.db is locked by another process for more than 1 s"):
            check_services(1.0)
    finally:
        holder.rollback()
        holder.close()
    check_services(1.0)  # released: fine again


def test_what_a_clusters_gcs_says_is_one_line_naming_the_variable_and_the_fix(monkeypatch, tmp_path):
    import platform

    import ray

    from components.services import gcs_verdict

    address = "10.0.0.1:6379"
    refused = {"error": "AuthenticationError", "message": "RPC error: InvalidAuthToken"}
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "none"))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert "sends none (it has none); set RAY_AUTH_TOKEN" in gcs_verdict(address, refused)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "abc")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert "sends none (RAY_AUTH_MODE=disabled)" in gcs_verdict(address, refused)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert gcs_verdict(address, refused).startswith(
        f"RAY_ADDRESS={address}: the cluster refused this process's"
    )
    ours = {"ray_version": ray.__version__, "python_version": platform.python_version()}
    assert gcs_verdict(address, ours) is None
    older = gcs_verdict(address, {**ours, "ray_version": "2.9.0"})
    assert (
        f"runs Ray 2.9.0 on Python {platform.python_version()}, this environment Ray {ray.__version__}"
        in older
    )
    assert "install ray==2.9.0" in older


def test_a_driver_of_a_cluster_sends_the_token_it_has(monkeypatch, tmp_path):
    from components.env import local_defaults

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    assert "RAY_AUTH_MODE" not in local_defaults()  # no token: Ray's default (no auth) stands
    (tmp_path / "auth_token").write_text("t0ken")
    assert local_defaults()["RAY_AUTH_MODE"] == "token"
    monkeypatch.delenv("RAY_ADDRESS")
    assert "RAY_AUTH_MODE" not in local_defaults()  # a local instance: Ray turns it on itself


def test_a_port_that_is_not_a_ray_gcs_says_so_within_the_timeout():
    import socket
    import threading
    import time

    from components.services import ray_problem

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    threading.Thread(target=lambda: [server.accept() for _ in range(50)], daemon=True).start()
    started = time.monotonic()
    why = ray_problem(f"127.0.0.1:{server.getsockname()[1]}", 6.0)
    assert time.monotonic() - started < 8.0
    assert "the port is open but no Ray GCS answers there" in why and "RAY_ADDRESS=127.0.0.1:" in why
    server.close()


class _Answer:
    """A local HTTP server that answers every GET with one status and body (not Prefect)."""

    def __init__(self, status: int, body: bytes):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(status)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    ("status", "body", "why"),
    [
        (200, b"OK", "it answered b'OK', not JSON"),
        (404, b"not found", "it answered HTTP 404"),
        (200, b'{"status": "healthy"}', "its /health answered"),
        (200, b"true", "its /ready answered 'True', not Prefect's message"),  # true to every path
        (401, b"{}", "it answered HTTP 401"),
    ],
)
def test_a_prefect_api_url_that_answers_but_is_not_prefect_is_one_line(status, body, why):
    from components.services import prefect_problem

    other = _Answer(status, body)
    try:
        problem = prefect_problem(other.url, 3.0)
    finally:
        other.close()
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"PREFECT_API_URL={other.url}: no Prefect API answers there ({why}")
