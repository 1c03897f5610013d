"""MLflow model registry: register a model only if it beats the registered one."""

from __future__ import annotations

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from components.tracking.mlflow_tracker import default_tracking_uri

ACC_TAG = "val_acc"


def best_registered_acc(client: MlflowClient, name: str) -> float | None:
    try:
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        return None
    accs = [float(v.tags[ACC_TAG]) for v in versions if ACC_TAG in v.tags]
    return max(accs) if accs else None


def register_if_better(name: str, run_id: str, artifact_path: str, acc: float) -> dict:
    """Register runs:/<run_id>/<artifact_path> as a new version of `name` when acc beats every version."""
    client = MlflowClient(default_tracking_uri())
    best = best_registered_acc(client, name)
    if best is not None and acc <= best:
        return {"registered": False, "reason": f"acc {acc:.4f} does not beat the registered {best:.4f}",
                "best": best}
    try:
        client.create_registered_model(name)
    except MlflowException:
        pass  # already exists
    source = f"{client.get_run(run_id).info.artifact_uri}/{artifact_path}"
    version = client.create_model_version(name, source, run_id=run_id, tags={ACC_TAG: str(acc)})
    return {"registered": True, "version": version.version, "acc": acc, "previous_best": best}
