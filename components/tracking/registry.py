"""MLflow model registry: every candidate becomes a version; aliases say which one serves.

A version points at a logged model (`models:/<id>`), whose files MLflow keeps apart from any run's artifacts,
so no later run can change what a version holds. Promotion compares the candidate's held-out accuracy with the
champion's measured on the same evaluation set (the same file, the same rows): the candidate takes the alias
`champion` when it is better, else `challenger`. The decision and its figures are tags of the version.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from components.tracking.mlflow_tracker import default_tracking_uri

CHAMPION, CHALLENGER = "champion", "challenger"
ACC, EVAL_SET = "eval_acc", "eval_set"


def _client() -> MlflowClient:
    import mlflow

    uri = default_tracking_uri()
    # MLflow's registry resolves `models:/<id>` sources with a client of the global URIs
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return MlflowClient(uri, registry_uri=uri)


def champion(name: str):
    """The version holding the `champion` alias, or None."""
    try:
        return _client().get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def download_version(name: str, version: str, dst: str | Path) -> Path:
    """The model directory of a registered version (the weights its logged model holds), copied under `dst`."""
    import mlflow
    from mlflow.models import Model

    from components.tracking.policy_model import WEIGHTS

    client = _client()
    source = client.get_model_version(name, version).source  # models:/<logged model id>
    location = client.get_logged_model(source.removeprefix("models:/")).artifact_location
    logged = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=location, dst_path=str(dst), tracking_uri=default_tracking_uri()
        )
    )
    artifacts = Model.load(logged / "MLmodel").flavors["python_function"]["artifacts"]
    return logged / artifacts[WEIGHTS]["path"]


def register_candidate(
    name: str, model_id: str, run_id: str, acc: float, eval_set: str, measure: Callable[[str], float]
) -> dict:
    """Register logged model `model_id` (held-out accuracy `acc` on the evaluation set `eval_set`, a digest of
    the file and rows) as a new version of `name` and decide its alias. The champion's accuracy is the one it
    was registered with when that was measured on the same set; otherwise `measure(version)` measures it now
    on this one. Returns the decision with its figures (also set as tags of the new version)."""
    client = _client()
    try:
        client.create_registered_model(name)
    except MlflowException:
        pass  # already exists
    current = champion(name)
    version = client.create_model_version(
        name,
        f"models:/{model_id}",
        run_id=run_id,
        model_id=model_id,
        tags={ACC: str(acc), EVAL_SET: eval_set},
    ).version
    version = str(version)
    if current is None:
        decision = {"alias": CHAMPION, "reason": "the first version of this model"}
    else:
        same_set = current.tags.get(EVAL_SET) == eval_set and ACC in current.tags
        champ_acc = float(current.tags[ACC]) if same_set else measure(str(current.version))
        better = acc > champ_acc
        decision = {
            "alias": CHAMPION if better else CHALLENGER,
            "champion_version": str(current.version),
            "champion_acc": champ_acc,
            "champion_acc_measured_now": not same_set,
            "reason": f"acc {acc:.4f} {'beats' if better else 'does not beat'} the champion's "
            f"{champ_acc:.4f} on the same evaluation set",
        }
    client.set_registered_model_alias(name, decision["alias"], version)
    for key, value in decision.items():
        client.set_model_version_tag(name, version, f"decision.{key}", str(value))
    return {
        "name": name,
        "version": version,
        "acc": acc,
        "eval_set": eval_set,
        "model_id": model_id,
        **decision,
    }
