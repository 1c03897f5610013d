"""Process defaults for the embedded services, set before Prefect or Ray are imported.

Each is only a default: a value already in the environment wins.
"""

import os
import re
import secrets
import stat
import sys
from pathlib import Path

from components.errors import ConfigError

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


# MLflow's own default store and artifact root (a tool run in the checkout with no MLFLOW_TRACKING_URI, such as
# `mlflow ui` or mlflow.pyfunc.load_model, opens the same runs); mlruns.db is the name this project used before
MLFLOW_STORE, MLFLOW_ARTIFACTS, OLD_STORE = "mlflow.db", "mlruns", "mlruns.db"


def default_tracking_uri(root: Path | None = None) -> str:
    """MLFLOW_TRACKING_URI, else the SQLite store of the checkout (checkout_root): a DVC experiment trained in
    a temporary copy logs to the store of the checkout it was started from."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root or checkout_root()) / MLFLOW_STORE}"


def adopt_old_store(root: Path) -> None:
    """A checkout whose runs are in OLD_STORE (and none in MLFLOW_STORE) has it renamed, once, so its runs stay
    where every tool looks (their artifacts are recorded by absolute path and do not move)."""
    old, new = root / OLD_STORE, root / MLFLOW_STORE
    if not os.environ.get("MLFLOW_TRACKING_URI") and old.is_file() and not new.exists():
        try:
            os.replace(old, new)
        except OSError:
            return  # a read-only checkout: the runs stay in the old store, which the URI no longer names
        print(f"reinforge: moved {old} to {new} (MLflow's own default store name)", file=sys.stderr)


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


AUTH_FORMAT = re.compile(r"^reinforge:[A-Za-z0-9_-]{32}$")
# what was wrong with this checkout's auth file, if anything: the commands refuse to start on it (check_auth)
auth_problem: list[str] = []


def read_auth(path: Path) -> str:
    """The auth string in `path`, a regular file of this user's that no one else can read or write, holding
    one string of AUTH_FORMAT; ConfigError naming the file, what is wrong and the fix otherwise (an empty
    one, which a crash between creating and writing it leaves, would turn the API's auth off)."""
    st = os.lstat(path)  # FileNotFoundError: there is none yet
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file (a link or a directory)"
    elif st.st_uid != os.getuid():
        why = f"belongs to another user (uid {st.st_uid})"
    elif st.st_mode & 0o077:
        why = f"can be read or written by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        text = path.read_text(errors="replace").strip()
        if AUTH_FORMAT.match(text):
            return text
        why = "is empty" if not text else "does not hold an auth string reinforge wrote"
    raise ConfigError(
        f"{path}, the embedded Prefect API's auth file, {why}; an altered one could leave the API open to other "
        "local users. Delete it (the next command makes a new one), or run with PREFECT_API_URL set."
    )


def write_auth(path: Path) -> None:
    """A new auth string in `path`, whole or not at all: written and synced under a temporary name, then linked
    to `path` (a concurrent writer's file, if it got there first, is kept)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"reinforge:{secrets.token_urlsafe(24)}\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def prefect_auth_string() -> str:
    """The basic-auth string of this checkout's embedded Prefect API (Prefect's own server.api.auth_string),
    made once and kept in a file only this user can read: another local user cannot change a run's state."""
    path = checkout_root() / AUTH_FILE
    try:
        return read_auth(path)
    except FileNotFoundError:
        write_auth(path)
        return read_auth(path)


def check_auth() -> None:
    """ConfigError when this checkout's auth file was found empty or altered (every command's first check)."""
    if auth_problem:
        raise ConfigError(auth_problem[0])


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
        except ConfigError as exc:  # refused by the commands (check_auth); till then the API stays guarded
            auth_problem[:] = [str(exc)]
            auth = f"reinforge:{secrets.token_urlsafe(24)}"
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
    # what this process and those it starts write (stores, checkpoints, logs, results) no other local user reads
    os.umask(os.umask(0o077) | 0o077)
    for key, value in {**DEFAULTS, **local_defaults()}.items():
        os.environ.setdefault(key, value)
    adopt_old_store(checkout_root())
