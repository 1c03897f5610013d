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


def apply_defaults() -> None:
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
