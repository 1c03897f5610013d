"""MLflow model registry: every candidate becomes a version; aliases say which one serves.

A version points at a logged model (`models:/<id>`), whose files MLflow keeps apart from any run's artifacts,
so no later run can change what a version holds. Promotion compares the candidate's held-out accuracy with the
champion's measured on the same evaluation set (the same file, the same rows): the candidate takes the alias
`champion` when it is better, else `challenger`. The decision and its figures are tags of the version.

The gate is two pure functions over what the registry records: `find_champion` (the alias's version, or, when
the alias is missing, dangling or on a version without a finite metric, the best version with one) and
`decide`. A non-finite metric never promotes and is never a champion to beat.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from components.errors import ReinforgeError
from components.tracking.mlflow_tracker import default_tracking_uri, store_ready

CHAMPION, CHALLENGER = "champion", "challenger"
ACC, EVAL_SET = "eval_acc", "eval_set"


def _client() -> MlflowClient:
    import mlflow

    uri = default_tracking_uri()
    # MLflow's registry resolves `models:/<id>` sources with a client of the global URIs
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    with store_ready(uri) as client:
        return client


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


class PromotionRefused(ReinforgeError):
    """The registry's state leaves no champion to compare with and no safe guess: a person decides."""


@dataclass(frozen=True)
class Recorded:
    """A registered version as the gate sees it: its number and the held-out metric it was registered with
    (None when the tag is missing or not a number) on its evaluation set."""

    version: str
    acc: float | None
    eval_set: str | None

    @property
    def valid(self) -> bool:
        return self.acc is not None and math.isfinite(self.acc)

    @classmethod
    def of(cls, mv) -> Recorded:
        """From an MLflow ModelVersion's tags."""
        try:
            acc = float(mv.tags[ACC])
        except (KeyError, TypeError, ValueError):
            acc = None
        return cls(str(mv.version), acc, mv.tags.get(EVAL_SET))


def find_champion(
    name: str, alias_version: str | None, versions: list[Recorded], eval_set: str
) -> tuple[Recorded | None, str]:
    """The version to beat and how it was found. The alias's version when it exists with a finite metric;
    otherwise the best version with a finite metric (on `eval_set` if any is, else on any set; the earliest of
    equals, which the later ones did not beat), or None when no version has one. An alias on a version that no
    longer exists, with no finite metric anywhere to recover from, is refused (PromotionRefused)."""
    by_number = {r.version: r for r in versions}
    if alias_version in by_number and by_number[alias_version].valid:
        return by_number[alias_version], "the champion alias"
    if alias_version is None:
        why = "no version holds the champion alias"
    elif alias_version not in by_number:
        why = f"the champion alias points at version {alias_version}, which no longer exists"
    else:
        why = f"the champion, version {alias_version}, has no finite recorded {ACC} ({by_number[alias_version].acc})"
    usable = [r for r in versions if r.valid]
    if not usable:
        if alias_version is not None and alias_version not in by_number:
            raise PromotionRefused(
                f"registered model {name}: {why}, and no other version has a finite recorded {ACC} to recover "
                f"the champion from. Set the alias by hand (MlflowClient().set_registered_model_alias("
                f"'{name}', 'champion', <version>)) or delete it, then run again."
            )
        return None, f"{why}; no version has a finite recorded {ACC}"
    pool = [r for r in usable if r.eval_set == eval_set] or usable
    best = max(pool, key=lambda r: (r.acc, -int(r.version)))
    return best, f"{why}; recovered as version {best.version}, the best finite recorded {ACC}"


def decide(
    acc: float, champ: Recorded | None, champ_acc: float | None, found: str, alias_version: str | None
) -> dict:
    """The candidate's alias and why: `champion` only for a finite `acc` that beats the champion's `champ_acc`
    (measured on the candidate's evaluation set; a non-finite one is beaten by any finite figure), or with no
    champion at all; else `challenger`. A champion that is not the version the alias names (`alias_version`:
    recovered from the records, as `found` says) and keeps its title takes the alias back (`restore_champion`),
    so `models:/<name>@champion` serves it again."""
    recovered = champ is not None and champ.version != alias_version
    kept = {"restore_champion": champ.version} if recovered else {}
    if not math.isfinite(acc):
        reason = f"its held-out acc is {acc}: a non-finite metric never promotes"
        return {"alias": CHALLENGER, "reason": reason, "champion_found": found, **kept}
    if champ is None:
        return {"alias": CHAMPION, "reason": f"the first version with a finite metric ({found})"}
    better = champ_acc is None or not math.isfinite(champ_acc) or acc > champ_acc
    return {
        "alias": CHAMPION if better else CHALLENGER,
        "champion_version": champ.version,
        "champion_acc": champ_acc,
        "champion_found": found,
        "reason": f"acc {acc:.4f} {'beats' if better else 'does not beat'} the champion's "
        f"{champ_acc:.4f} on the same evaluation set",
        **({} if better else kept),
    }


def alias_target(client: MlflowClient, name: str) -> str | None:
    """The version number the champion alias names, whether or not that version still exists."""
    aliases = client.get_registered_model(name).aliases or {}
    return str(aliases[CHAMPION]) if CHAMPION in aliases else None


def register_candidate(
    name: str, model_id: str, run_id: str, acc: float, eval_set: str, measure: Callable[[str], float]
) -> dict:
    """Register logged model `model_id` (held-out accuracy `acc` on the evaluation set `eval_set`, a digest of
    the file and rows) as a new version of `name` and decide its alias (find_champion, then decide). The
    champion's accuracy is the one it was registered with when that was measured on the same set; otherwise
    `measure(version)` measures it now on this one. Returns the decision with its figures (also set as tags of
    the new version)."""
    client = _client()
    try:
        client.create_registered_model(name)
    except MlflowException:
        pass  # already exists
    versions = [Recorded.of(mv) for mv in client.search_model_versions(f"name='{name}'")]
    alias = alias_target(client, name)
    champ, found = find_champion(name, alias, versions, eval_set)
    measured_now = champ is not None and champ.eval_set != eval_set
    champ_acc = (measure(champ.version) if measured_now else champ.acc) if champ is not None else None
    decision = decide(acc, champ, champ_acc, found, alias)
    if champ is not None:
        decision["champion_acc_measured_now"] = measured_now
    version = client.create_model_version(
        name,
        f"models:/{model_id}",
        run_id=run_id,
        model_id=model_id,
        tags={ACC: str(acc), EVAL_SET: eval_set},
    ).version
    version = str(version)
    client.set_registered_model_alias(name, decision["alias"], version)
    if "restore_champion" in decision:
        client.set_registered_model_alias(name, CHAMPION, decision["restore_champion"])
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
