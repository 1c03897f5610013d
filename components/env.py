"""Process defaults for the embedded services, set before Prefect or Ray are imported.

Each is only a default: a value already in the environment wins.
"""

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Prefect persists stage results here, in this checkout: never shared with another checkout or user through
# ~/.prefect/storage (`make clean` removes it)
RESULTS_DIR = PROJECT_ROOT / ".prefect-results"

DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no telemetry calls from the ephemeral server
    "PREFECT_LOGGING_SERVER_LEVEL": "CRITICAL",  # the ephemeral server's shutdown chatter
    "PREFECT_LOGGING_LEVEL": "WARNING",
    # the run loggers at INFO: the per-iteration line and the stages' decisions reach the flow run's Logs tab
    # in the UI; the terminal shows warnings (and our own progress line)
    "PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL": "INFO",
    "PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL": "INFO",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",  # a loaded 2-core machine starts it slowly
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "1",
    "HF_HUB_OFFLINE": "1",  # nothing is downloaded: models come from local paths
    "TRANSFORMERS_VERBOSITY": "error",
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # its "Creating initial MLflow database tables..." on every new store
    # its artifact download bars (a logged model copied for evaluation) bury the run's own progress lines
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(RESULTS_DIR),
}


def checkout_root() -> Path:
    """The checkout whose MLflow store a run logs to. A DVC stage names it in DVC_ROOT: `dvc exp run --temp`
    and `--queue` train in a copy under .dvc/tmp/exps/, deleted afterwards, and DVC_ROOT is the checkout the
    experiment was started from. Anything else: this package's checkout."""
    root = os.environ.get("DVC_ROOT")
    return Path(root).resolve() if root else PROJECT_ROOT


def dvc_experiment() -> dict[str, str]:
    """The DVC experiment this process runs in (`dvc exp run`): its name and baseline commit, as DVC's own
    variables give them; empty outside one."""
    name, rev = os.environ.get("DVC_EXP_NAME"), os.environ.get("DVC_EXP_BASELINE_REV")
    return {"name": name, "baseline_rev": rev or ""} if name else {}


# in the checkout, mode 0600: the embedded Prefect API's basic-auth string
AUTH_FILE = ".prefect-auth"
# Ray's switch for a single-node instance on loopback (its node address 127.0.0.1, its agents bound there); a
# driver of a cluster (RAY_ADDRESS) must not have it
RAY_LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def prefect_auth_string() -> str:
    """The basic-auth string of this checkout's embedded Prefect API (Prefect's own server.api.auth_string),
    made once and kept in a file only this user can read: another local user cannot change a run's state."""
    import secrets

    path = checkout_root() / AUTH_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    value = f"reinforge:{secrets.token_urlsafe(24)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def ray_token_at_hand() -> bool:
    """A Ray auth token this process can send: RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or
    ~/.ray/auth_token (which `ray start` and every local instance write)."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or Path(path).is_file()


def local_defaults() -> dict[str, str]:
    """What only a run's own, embedded services get: Prefect's API auth on both sides when no PREFECT_API_URL
    names a server of the user's, and Ray's processes on loopback when no RAY_ADDRESS names a cluster (Ray binds
    its node's routable address otherwise, and its metrics endpoints take no auth). A driver of a cluster sends
    its token when one is at hand: `ray start --head` turns token auth on wherever ~/.ray/auth_token exists, but
    Ray's driver sends it to an address it is given only in RAY_AUTH_MODE=token (a cluster without auth ignores
    the token)."""
    out = {}
    if not os.environ.get("PREFECT_API_URL"):
        try:
            auth = prefect_auth_string()
        except OSError:  # a read-only checkout: the embedded server runs as Prefect's default does
            auth = None
        if auth:
            out.update(PREFECT_SERVER_API_AUTH_STRING=auth, PREFECT_API_AUTH_STRING=auth)
    if not os.environ.get("RAY_ADDRESS"):
        out[RAY_LOOPBACK] = "0"
    elif ray_token_at_hand():
        out["RAY_AUTH_MODE"] = "token"
    return out


def apply_defaults() -> None:
    for key, value in {**DEFAULTS, **local_defaults()}.items():
        os.environ.setdefault(key, value)
