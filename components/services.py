"""The services a run depends on answer, or the run stops with one line naming the variable, the address and
the fix: Ray (RAY_ADDRESS), MLflow (MLFLOW_TRACKING_URI), Prefect (PREFECT_API_URL). Unset, each is embedded
(local Ray, SQLite, Prefect's in-process server) and nothing is checked.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from components.env import default_tracking_uri
from components.errors import ServiceError


def _tcp(host: str, port: int, timeout_s: float) -> str | None:
    """None when something accepts a connection at host:port within the timeout, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _unanswered(exc: Exception) -> str:
    """Why a URL did not answer, as urllib's error says it (connection refused, a timeout, a bad URL)."""
    reason = getattr(exc, "reason", exc)
    return getattr(reason, "strerror", None) or str(reason)


def _http(url: str, timeout_s: float) -> str | None:
    """None when `url` answers (any HTTP status) within the timeout, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return _unanswered(exc)


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
    if parsed.scheme != "gcs":  # Ray Client (ray://) or a dashboard: no GCS to ask at that port
        return None
    return gcs_problem(address, timeout_s)


# asks the cluster's GCS for its metadata (Ray's and Python's versions), as a driver does first; in a child
# process, so the C++ client's retry warnings stay off the user's terminal and a hang can be cut short
GCS_PROBE = """
import json, sys
from ray._raylet import GcsClient
try:
    raw = GcsClient(address=sys.argv[1]).internal_kv_get(b"CLUSTER_METADATA", b"cluster", float(sys.argv[2]))
    print(json.dumps(json.loads(raw or b"{}")))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc).split(". ")[0]}))
"""


def gcs_problem(address: str, timeout_s: float) -> str | None:
    """Why a driver could not join the Ray cluster whose GCS listens at `address` (gcs_verdict), asked of the
    GCS itself; None when a driver can join."""
    import json
    import subprocess
    import sys

    try:
        res = subprocess.run(
            [sys.executable, "-c", GCS_PROBE, address, str(max(timeout_s - 2.0, 1.0))],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        found = json.loads(res.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, ValueError):
        found = {"error": "no answer", "message": f"its GCS said nothing within {timeout_s:g} s"}
    return gcs_verdict(address, found)


def gcs_verdict(address: str, found: dict) -> str | None:
    """What the GCS probe `found` means for a driver: its token auth refused us (no token sent, or the wrong
    one), it did not answer as a GCS, or it runs another Ray or Python than this environment (Ray refuses a
    driver that differs); None when a driver can join."""
    import platform

    import ray

    from components.env import ray_token_at_hand

    error = found.get("error")
    sent = os.environ.get("RAY_AUTH_MODE") == "token" and ray_token_at_hand()
    if error == "AuthenticationError" and not sent:
        why = "RAY_AUTH_MODE=disabled" if os.environ.get("RAY_AUTH_MODE") == "disabled" else "it has none"
        return (
            f"RAY_ADDRESS={address}: the cluster requires a Ray auth token and this process sends none ({why}); "
            "set RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on its head node prints it) and "
            "leave RAY_AUTH_MODE unset."
        )
    if error == "AuthenticationError":
        return (
            f"RAY_ADDRESS={address}: the cluster refused this process's Ray auth token (RAY_AUTH_TOKEN, "
            "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token); set RAY_AUTH_TOKEN to the one `ray get-auth-token` "
            "prints on its head node."
        )
    if error:
        return (
            f"RAY_ADDRESS={address}: the port is open but no Ray GCS answers there ({found['message']}); point "
            "RAY_ADDRESS at the head node's GCS port (`ray start --head --port`, 6379 by default)."
        )
    # Ray's own rule: the same Ray, and the same Python down to the patch level
    theirs = (found.get("ray_version"), found.get("python_version"))
    ours = (ray.__version__, platform.python_version())
    if found and theirs != ours:
        return (
            f"RAY_ADDRESS={address}: the cluster runs Ray {theirs[0]} on Python {theirs[1]}, this environment "
            f"Ray {ours[0]} on Python {ours[1]}; a driver must match: install ray=={theirs[0]} on Python "
            f"{theirs[1]} here, or start the cluster from this environment."
        )
    return None


def sqlite_store_problem(uri: str, timeout_s: float) -> str | None:
    """An SQLite tracking store (sqlite:///path) that exists but is not a database, or that another process
    keeps locked for longer than timeout_s: why, naming the file and the fix. A missing file is made on first
    use."""
    import sqlite3

    path = uri[len("sqlite:///") :]
    if not os.path.exists(path):
        return None
    try:
        con = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=timeout_s)
        try:
            con.execute("SELECT count(*) FROM sqlite_master").fetchone()
            con.execute("BEGIN IMMEDIATE")  # the write lock, as MLflow takes it, released at once
            con.execute("ROLLBACK")
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            return (
                f"MLflow's store {path} is locked by another process for more than {timeout_s:g} s; wait for "
                f"it to finish (`fuser {path}` names it), or set MLFLOW_TRACKING_URI to another store."
            )
        return (
            f"MLflow's store {path} is not a readable SQLite database ({exc}); move it aside (`mv {path} "
            f"{path}.bad`) to start a new store, or set MLFLOW_TRACKING_URI to another one."
        )
    return None


def mlflow_problem(uri: str, timeout_s: float) -> str | None:
    if uri.startswith("sqlite:///"):
        return sqlite_store_problem(uri, timeout_s)
    if not uri.startswith(("http://", "https://")):
        return None  # another database or a file store: MLflow opens it itself
    why = _http(uri.rstrip("/") + "/health", timeout_s)
    if why:
        return (
            f"MLFLOW_TRACKING_URI={uri}: no MLflow server answers there ({why}, within {timeout_s:g} s). Start "
            "it (`mlflow server`), fix the URI, or unset MLFLOW_TRACKING_URI to log to mlflow.db here."
        )
    return None


def _http_json(url: str, timeout_s: float) -> tuple[object, str | None]:
    """(the JSON `url` answers with a 200, None), or (None, why not): no answer, another status, not JSON."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read(4096)
    except urllib.error.HTTPError as exc:
        return None, f"it answered HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, _unanswered(exc)
    try:
        return json.loads(body), None
    except ValueError:
        return None, f"it answered {body[:40]!r}, not JSON"


def prefect_problem(url: str, timeout_s: float) -> str | None:
    """None when Prefect's API answers at `url`: its /health says `true` and its /ready a JSON message (both
    open without the API's auth). Any other HTTP server there would fail the run minutes later."""
    base = url.rstrip("/")
    health, why = _http_json(base + "/health", timeout_s)
    if why is None and health is not True:
        why = f"its /health answered {str(health)[:40]!r}, not Prefect's true"
    if why is None:
        ready, why = _http_json(base + "/ready", timeout_s)
        if why is None and not (isinstance(ready, dict) and "message" in ready):
            why = f"its /ready answered {str(ready)[:40]!r}, not Prefect's message"
    if why:
        return (
            f"PREFECT_API_URL={url}: no Prefect API answers there ({why}, within {timeout_s:g} s). Start it "
            "(`prefect server start`), fix the URL (it ends in /api), or unset PREFECT_API_URL to use "
            "Prefect's in-process server."
        )
    return None


def check_services(timeout_s: float = 15.0, ray: bool = True) -> None:
    """ServiceError (one line each) for every configured service that does not answer within timeout_s;
    RAY_ADDRESS's cluster only when the run's workers are Ray actors (`ray`)."""
    checks = [
        *([(ray_problem, "RAY_ADDRESS")] if ray else []),
        (mlflow_problem, "MLFLOW_TRACKING_URI"),
        (prefect_problem, "PREFECT_API_URL"),
    ]
    own = {"PREFECT_API_URL"} if own_prefect_server() else set()  # ours: prefect_server_started waits for it
    problems = [
        check(os.environ[name], timeout_s)
        for check, name in checks
        if os.environ.get(name) and name not in own
    ]
    if not os.environ.get("MLFLOW_TRACKING_URI"):  # the embedded store: there, but broken or held
        problems.append(mlflow_problem(default_tracking_uri(), timeout_s))
    problems = [p for p in problems if p]
    if problems:
        raise ServiceError("\n  ".join(problems))


def check_run_services(cfg) -> None:
    """check_services for a run of `cfg` (a Config): within trainer.connect_timeout_s, and RAY_ADDRESS's
    cluster only when its workers are Ray actors (trainer.backend)."""
    from components.config.names import RAY_BACKENDS
    from components.env import check_auth

    check_auth()  # a deployment's run, which no command checked
    check_services(cfg.trainer.connect_timeout_s, ray=cfg.trainer.backend in RAY_BACKENDS)


# uvicorn's command line, with Prefect's server package imported first with the collector paused (~0.9 of its
# ~3.7 CPU-seconds to its first answer, on the cores the run's own start-up needs)
SERVE_PREFECT = (
    "import gc, sys; gc.disable(); import prefect.server.api.server; gc.freeze(); gc.enable(); "
    "from uvicorn.main import main; sys.argv[0] = 'uvicorn'; main()"
)

# the Prefect API server this process started for itself (start_prefect_server_early): its process and URL
_own_server: dict = {}


def start_prefect_server_early() -> None:
    """Start Prefect's in-process API server now, as `reinforge` parses its command, when the run will need
    it (no PREFECT_API_URL): the same uvicorn child Prefect's ephemeral mode starts, launched here without
    importing Prefect's server package (~3 s of this process's time, which a thread would take from the
    imports of torch, transformers and MLflow while they run). PREFECT_API_URL is set to it before Prefect
    is imported, so the flow reports to it; it takes ~4 s to answer, which the imports hide.
    prefect_server_started() waits for it; it is stopped when this process exits."""
    import atexit
    import importlib.util
    import subprocess
    import sys
    import tempfile

    if os.environ.get("PREFECT_API_URL") or _own_server:
        return
    with socket.socket() as probe:  # a free port: the server binds it a moment later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    package = Path(importlib.util.find_spec("prefect").origin).parent
    said = tempfile.TemporaryFile()  # noqa: SIM115 - kept open for the server's life
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_PREFECT, "--app-dir", str(package.parent), "--factory"]
        + ["prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port)]
        + ["--log-level", "error", "--lifespan", "on"],
        env={**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1"},
        stdout=subprocess.DEVNULL,
        stderr=said,  # a file, not a pipe: a pipe nobody reads would stall the server once full
        preexec_fn=_stop_with_parent,  # no threads yet: `reinforge` calls this before Ray or Prefect start
    )
    _own_server.update(proc=proc, url=f"http://127.0.0.1:{port}/api", said=said)
    os.environ["PREFECT_API_URL"] = _own_server["url"]
    atexit.register(_stop_own_server)


def _stop_with_parent() -> None:
    """In the server's process before it runs: Linux sends it SIGTERM when this process dies, even by SIGKILL,
    which skips atexit (PR_SET_PDEATHSIG); elsewhere the atexit stop alone."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop_own_server() -> None:
    proc = _own_server.get("proc")
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(5)
    except Exception:  # noqa: BLE001 - a server that ignores SIGTERM is killed
        proc.kill()


def own_prefect_server() -> int | None:
    """The pid of the Prefect server start_prefect_server_early started, if it did."""
    proc = _own_server.get("proc")
    return proc.pid if proc is not None else None


def prefect_server_started(timeout_s: float = 60.0) -> None:
    """Wait until start_prefect_server_early's server answers; at once when none was started early.
    ServiceError with its last words when it exits or does not answer within timeout_s."""
    import time

    proc, url = _own_server.get("proc"), _own_server.get("url")
    if proc is None or _own_server.get("up"):
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if _http(url + "/health", 1.0) is None:
            _own_server["up"] = True
            return
        time.sleep(0.05)
    _stop_own_server()
    _own_server["said"].seek(0)
    said = _own_server["said"].read().decode(errors="replace").strip()
    raise ServiceError(
        f"Prefect's in-process API server did not start ({said.splitlines()[-1] if said else 'no answer'} "
        f"within {timeout_s:g} s); see `prefect server start`, or set PREFECT_API_URL to a running server."
    )


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
    """Whether the Prefect server this run reports to still answers (the in-process server's process, or the
    server at PREFECT_API_URL: a quick health request), and whether the run's flow run is still Running there:
    a state another client set (Cancelled from the UI, or by anyone holding the API) stops the run instead of
    letting it train on and report success. Checked at each iteration boundary, the state at most every
    `state_every_s`."""

    def __init__(self, timeout_s: float = 15.0, flow_run_id=None, state_every_s: float = 2.0):
        own = own_prefect_server()  # started by this process: watched as its child, like Prefect's own
        self.url = None if own else os.environ.get("PREFECT_API_URL")
        self.pid = own or (None if self.url else prefect_server_pid())
        self.timeout_s = timeout_s  # a busy server answers late; a dead one refuses at once
        self.flow_run_id, self.state_every_s, self._state_read = flow_run_id, state_every_s, 0.0

    def problem(self) -> str | None:
        import psutil

        if self.url:
            down = prefect_problem(self.url, self.timeout_s)
            return down or self.state_problem()
        if self.pid is None:
            return self.state_problem()
        try:
            alive = psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        return self.state_problem() if alive else f"Prefect's in-process API server (pid {self.pid}) has died"

    def state_problem(self) -> str | None:
        import time

        if self.flow_run_id is None or time.monotonic() - self._state_read < self.state_every_s:
            return None
        self._state_read = time.monotonic()
        from prefect import get_client

        with get_client(sync_client=True) as client:
            run = client.read_flow_run(self.flow_run_id)
        if run.state is None or run.state.is_running():
            return None
        return (
            f"the flow run {run.name} was set to {run.state.name} by another client (the Prefect UI or API) "
            "while it trained, so the run stops here"
        )
