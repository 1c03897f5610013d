"""Process defaults for the embedded services, set before Prefect or Ray are imported.

Each is only a default: a value already in the environment wins.
"""

import os

DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no telemetry calls from the ephemeral server
    "PREFECT_LOGGING_SERVER_LEVEL": "CRITICAL",  # the ephemeral server's shutdown chatter
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",  # a loaded 2-core machine starts it slowly
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "1",
    "HF_HUB_OFFLINE": "1",  # nothing is downloaded: models come from local paths
    "TRANSFORMERS_VERBOSITY": "error",
}


def apply_defaults() -> None:
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
