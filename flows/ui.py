"""`reinforge ui`: MLflow's UI on this checkout's tracking store, and the link that opens its runs.

MLflow 3.17's UI shows every experiment in its GenAI view (traces, evaluations) until the sidebar's toggle says
"Model training": it reads the browser's toggle, not the experiment's type tag (`mlflow.experimentKind`, which
reinforge sets to custom_model_development). The link printed here carries `workflowType=machine_learning`, the
UI's own parameter for that toggle, so the experiment opens on its runs table; the UI keeps it as you navigate.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

from components.tracking.mlflow_tracker import default_tracking_uri
from flows import parsers

MODEL_TRAINING = "workflowType=machine_learning"


def experiment_url(base: str, experiment_id: str | None) -> str:
    """The page that lists the experiment's runs (the experiments list when there is none yet)."""
    page = f"#/experiments/{experiment_id}/runs" if experiment_id else "#/experiments"
    return f"{base.rstrip('/')}/{page}?{MODEL_TRAINING}"


def experiment_id(uri: str, name: str) -> str | None:
    from mlflow.tracking import MlflowClient

    experiment = MlflowClient(uri).get_experiment_by_name(name)
    return experiment.experiment_id if experiment else None


def wait_until_up(base: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2):
                return True
        except OSError:
            time.sleep(0.5)
    return False


def main(argv: list[str] | None = None) -> int:
    a = parsers.ui().parse_args(argv)
    uri = default_tracking_uri()
    if uri.startswith(("http://", "https://")):  # a tracking server: its UI is already there
        print(experiment_url(uri, experiment_id(uri, a.experiment)))
        return 0
    base = f"http://{a.host}:{a.port}"
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", a.host]
    proc = subprocess.Popen([*cmd, "--port", str(a.port)])
    try:
        if not wait_until_up(base, proc):
            print(
                f"error: the MLflow UI did not start on {base} (is the port taken? --port)", file=sys.stderr
            )
            return 2
        print(f"MLflow UI: {experiment_url(base, experiment_id(uri, a.experiment))}", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
