"""The services a run depends on answer, or the run stops with one line naming the variable, the address and
the fix: Ray (RAY_ADDRESS), MLflow (MLFLOW_TRACKING_URI), Prefect (PREFECT_API_URL). Unset, each is embedded
(local Ray, SQLite, Prefect's in-process server) and nothing is checked.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.error
import urllib.request
from urllib.parse import urlparse

from components.errors import ServiceError


def _tcp(host: str, port: int, timeout_s: float) -> str | None:
    """None when something accepts a connection at host:port within the timeout, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _http(url: str, timeout_s: float) -> str | None:
    """None when `url` answers (any HTTP status) within the timeout, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return getattr(reason, "strerror", None) or str(reason)


def ray_problem(address: str, timeout_s: float) -> str | None:
    """RAY_ADDRESS ("host:port", "ray://host:port", "http://host:port"); "auto"/"local" are Ray's own."""
    if address in ("auto", "local"):
        return None
    parsed = urlparse(address if "://" in address else f"gcs://{address}")
    if not parsed.hostname or not parsed.port:
        return (
            f"RAY_ADDRESS={address}: not an address (host:port, ray://host:port). Fix it, or unset RAY_ADDRESS "
            "to start Ray locally."
        )
    why = _tcp(parsed.hostname, parsed.port, timeout_s)
    if why:
        return (
            f"RAY_ADDRESS={address}: no Ray cluster answers there ({why}, within {timeout_s:g} s). Start it "
            "(`ray start --head`), fix the address, or unset RAY_ADDRESS to start Ray locally."
        )
    return None


def mlflow_problem(uri: str, timeout_s: float) -> str | None:
    if not uri.startswith(("http://", "https://")):
        return None  # a file or database: MLflow opens it itself
    why = _http(uri.rstrip("/") + "/health", timeout_s)
    if why:
        return (
            f"MLFLOW_TRACKING_URI={uri}: no MLflow server answers there ({why}, within {timeout_s:g} s). Start "
            "it (`mlflow server`), fix the URI, or unset MLFLOW_TRACKING_URI to log to mlruns.db here."
        )
    return None


def prefect_problem(url: str, timeout_s: float) -> str | None:
    why = _http(url.rstrip("/") + "/health", timeout_s)
    if why:
        return (
            f"PREFECT_API_URL={url}: no Prefect server answers there ({why}, within {timeout_s:g} s). Start it "
            "(`prefect server start`), fix the URL, or unset PREFECT_API_URL to use Prefect's in-process server."
        )
    return None


def check_services(timeout_s: float = 15.0) -> None:
    """ServiceError (one line each) for every configured service that does not answer within timeout_s."""
    checks = [
        (ray_problem, "RAY_ADDRESS"),
        (mlflow_problem, "MLFLOW_TRACKING_URI"),
        (prefect_problem, "PREFECT_API_URL"),
    ]
    problems = [check(os.environ[name], timeout_s) for check, name in checks if os.environ.get(name)]
    problems = [p for p in problems if p]
    if problems:
        raise ServiceError("\n  ".join(problems))


_early_start: list[threading.Thread] = []


def start_prefect_server_early() -> None:
    """Start Prefect's in-process API server now, in a background thread, when the run will need it (no
    PREFECT_API_URL). It is a subprocess that takes ~4 s to answer; started before this process imports
    torch, transformers and MLflow (~7 s on 2 cores), it is up when the flow begins instead of after.
    prefect_server_started() waits for it. Prefect keeps one such server per process: the flow finds it
    running. A start that fails here is left to the flow, which starts it again and reports what fails."""
    if os.environ.get("PREFECT_API_URL") or _early_start:
        return

    def start() -> None:
        from prefect.server.api.server import SubprocessASGIServer

        try:
            SubprocessASGIServer().start()
        except Exception:  # noqa: BLE001 - the flow's own start raises it, with Prefect's message
            return

    _early_start.append(threading.Thread(target=start, name="prefect-server-start", daemon=True))
    _early_start[0].start()


def prefect_server_started() -> None:
    """Wait until start_prefect_server_early's server answers (or its start failed); at once when none was
    started early."""
    for thread in _early_start:
        thread.join()


def prefect_server_pid() -> int | None:
    """The pid of Prefect's in-process API server (a uvicorn child of this process), if it runs one."""
    import psutil

    for child in psutil.Process().children():
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "uvicorn" in cmd and "prefect" in cmd:
            return child.pid
    return None


class PrefectWatch:
    """Whether the Prefect server this run reports to still answers: the in-process server's process, or the
    server at PREFECT_API_URL (a quick health request). Checked at each iteration boundary."""

    def __init__(self, timeout_s: float = 5.0):
        self.url = os.environ.get("PREFECT_API_URL")
        self.pid = None if self.url else prefect_server_pid()
        self.timeout_s = timeout_s

    def problem(self) -> str | None:
        import psutil

        if self.url:
            return prefect_problem(self.url, self.timeout_s)
        if self.pid is None:
            return None
        try:
            alive = psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        return None if alive else f"Prefect's in-process API server (pid {self.pid}) has died"
