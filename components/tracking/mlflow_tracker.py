"""MLflow tracking with embedded defaults: a SQLite file and an artifact folder in the project.

`MLFLOW_TRACKING_URI` is honoured. Metric names are sanitised (MLflow rejects '@'), and each (metric, step)
is logged once: one already logged is skipped, so a resumed run never logs a step twice. Per-step metrics
are logged asynchronously (MLflow's logging queue, off the training loop); `flush()` waits for them, and the
training flow flushes before each checkpoint, so a checkpoint never holds a step whose metrics are not
stored (a crash loses at most the metrics of steps after it, which the resumed run logs again).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from components.env import MLFLOW_ARTIFACTS, PROJECT_ROOT, default_tracking_uri, dvc_experiment
from components.locking import exclusive

# on a logged model: whether its held-out figures are linked to it, and where they are when they are not
EVALUATION_TAG = "reinforge.evaluation"
NOT_EVALUATED = (
    "not evaluated yet: `reinforge evaluate` (the pipeline's evaluate stage) links its held-out figures here. "
    "`dvc repro` skips that stage when this final model is byte-identical to the one dvc.lock records: its "
    "figures are then that commit's metrics/eval.json (`dvc metrics show`)."
)
_BAD = re.compile(r"[^A-Za-z0-9_\-./ ]")
# the experiment's kind: the UI opens a model-training experiment on its runs, not on the GenAI traces page
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


def metric_name(name: str) -> str:
    """MLflow-safe metric name: '@' becomes '_at_', other rejected characters become '_'."""
    return _BAD.sub("_", name.replace("@", "_at_"))


def git_commit(root: Path = PROJECT_ROOT) -> str:
    """The commit the code runs from; in a DVC experiment, the commit it was started from (its copy's HEAD
    is a stash commit that no branch holds)."""
    if dvc_experiment():
        return dvc_experiment()["baseline_rev"] or "unknown"
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@contextmanager
def store_ready(uri: str):
    """A client of `uri`, the block held under a lock beside a SQLite store (`mlflow.db.lock`), the store's
    tables made first. MLflow makes a new SQLite file's tables as it first opens it: two runs started at once
    in a fresh checkout (two triggered deployment runs) both did, and one failed ("duplicate column name:
    step"); both would also create the same experiment. Other stores (a server) serialise their own writes."""
    if not uri.startswith("sqlite:///"):
        yield MlflowClient(uri, registry_uri=uri)
        return
    db = Path(uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(db.with_name(db.name + ".lock"), f"opening the MLflow store {db}", wait_s=300):
        client = MlflowClient(uri, registry_uri=uri)  # made under the lock: opening may create the tables
        client.search_experiments(max_results=1)  # the tracking tables
        client.search_registered_models(max_results=1)  # and the registry's
        yield client


def setup(experiment: str, root: Path | None = None) -> str:
    """Point MLflow at the tracking URI and make sure the experiment exists; returns its id."""
    uri = default_tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    with store_ready(uri) as client:
        return _experiment(client, experiment, uri)


def _experiment(client: MlflowClient, experiment: str, uri: str) -> str:
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        if EXPERIMENT_KIND not in exp.tags:  # made by an older version, or by hand
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        return exp.experiment_id
    location = None
    if uri.startswith("sqlite:///"):  # artifacts beside the database file
        location = (Path(uri[len("sqlite:///") :]).parent / MLFLOW_ARTIFACTS / experiment).resolve().as_uri()
    return client.create_experiment(
        experiment, artifact_location=location, tags={EXPERIMENT_KIND: MODEL_TRAINING}
    )


def dataset_input(path: str, role: str, digest: str):
    """A data file as an MLflow dataset input: its schema and row count, its DVC md5 as the digest, `role`
    (train, eval) as the input's context, which the run page shows beside it."""
    import mlflow.data
    import pandas as pd
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource
    from mlflow.entities import DatasetInput, InputTag

    source = LocalArtifactDatasetSource(str(Path(path).resolve()))
    name, digest = dataset_ref(path, digest)
    try:
        df = pd.read_parquet(path) if path.endswith(".parquet") else pd.read_json(path, lines=True)
        dataset = mlflow.data.from_pandas(df, source=source, name=name, digest=digest)
    except (ValueError, TypeError, OSError, MlflowException):  # a schema MLflow cannot infer: source alone
        dataset = MetaDataset(source, name=name, digest=digest)
    return DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", role)])


def model_signature():
    """What the logged policy takes and returns, for the UI and for serving: prompt text in, completion out,
    with the sampling settings as params."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]),
        outputs=Schema([ColSpec("string", "completion")]),
        params=ParamSchema(
            [
                ParamSpec("max_new_tokens", "long", 16),
                ParamSpec("temperature", "double", 0.0),
                ParamSpec("seed", "long", 0),
            ]
        ),
    )


def dataset_ref(path: str, digest: str) -> tuple[str, str]:
    """The (name, digest) MLflow knows a data file by: a run's dataset input and the metrics measured on it."""
    return Path(path).stem, digest[:36]


def requirements() -> list[str]:
    """The packages the logged model loads with, at the versions installed here (reinforge itself too:
    serve it from this environment, `--env-manager local`)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for package in ("mlflow", "torch", "transformers", "tokenizers", "safetensors", "pandas"):
        try:
            out.append(f"{package}=={version(package)}")
        except PackageNotFoundError:
            continue
    return out


class Tracker:
    """One MLflow run: params, tags, per-step metrics (each step once), artifacts."""

    def __init__(self, experiment: str, run_name: str, run_id: str | None = None, root: Path | None = None):
        """A new run, or (run_id) the run a resumed training continues. A run_id this tracking store does not
        hold (a fresh MLFLOW_TRACKING_URI) starts a new run: `resumed` says which happened."""
        self.experiment_id = setup(experiment, root)
        uri = default_tracking_uri(root)
        self.client = MlflowClient(uri, registry_uri=uri)
        self.resumed = run_id is not None and self._exists(run_id)
        if self.resumed:
            self.client.update_run(run_id, status="RUNNING")
        else:
            run_id = self.client.create_run(self.experiment_id, run_name=run_name).info.run_id
        self.run_id = run_id
        self._logged = self._already_logged()
        self._pending: list = []  # MLflow RunOperations of metrics not yet known to be stored
        self._system_metrics = None

    def log_system_metrics(self, interval_s: float) -> None:
        """Sample CPU, memory, disk, network (and GPU, with pynvml) use into the run's system/* metrics every
        `interval_s`, in a thread of this process, until end()."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self._system_metrics = SystemMetricsMonitor(
            self.run_id,
            sampling_interval=interval_s,
            resume_logging=self.resumed,
            tracking_uri=default_tracking_uri(),
        )
        self._system_metrics.start()

    def log_inputs(self, datasets: list) -> None:
        """The run's dataset inputs (dataset_input), once: a resumed run has them already."""
        if not self.resumed:
            self.client.log_inputs(self.run_id, datasets=datasets)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def tag_model(self, model_id: str, tags: dict[str, str]) -> None:
        self.client.set_logged_model_tags(model_id, tags)

    def log_model(
        self, local_dir: str | Path, name: str, params: dict | None = None, model_config: dict | None = None
    ) -> str:
        """A model directory as an MLflow logged model of this run, with the pyfunc flavor
        (components/tracking/policy_model.py: `mlflow.pyfunc.load_model` generates with it), its signature,
        an input example and `params`. Its files go to the model's own artifact location
        (models/<id>/artifacts), which no later run writes, so a registered version that points at it never
        changes. `params` default to the run's (the resolved config); `model_config`: what the loaded model
        needs to know (how prompts are rendered). Returns the model id."""
        import mlflow.pyfunc
        from mlflow.models import Model

        from components.tracking import policy_model

        model = self.client.create_logged_model(
            self.experiment_id,
            name=name,
            source_run_id=self.run_id,
            model_type="text-generation",
            tags={EVALUATION_TAG: NOT_EVALUATED},
            params={
                k: str(v)[:6000]
                for k, v in (
                    params if params is not None else self.client.get_run(self.run_id).data.params
                ).items()
            },
        )
        try:
            with tempfile.TemporaryDirectory() as tmp:
                mlflow.pyfunc.save_model(
                    Path(tmp) / name,
                    python_model=policy_model.__file__,
                    artifacts={policy_model.WEIGHTS: str(local_dir)},
                    model_config=model_config or {},
                    signature=model_signature(),
                    input_example={"prompt": ["12+34="]},
                    pip_requirements=requirements(),
                    mlflow_model=Model(run_id=self.run_id, model_id=model.model_id),
                )
                self.client.log_model_artifacts(model.model_id, str(Path(tmp) / name))
        except BaseException:
            self.client.finalize_logged_model(model.model_id, "FAILED")
            raise
        self.client.finalize_logged_model(model.model_id, "READY")
        from mlflow.entities import LoggedModelOutput

        # an output of this run: the run page lists it under "Logged models"
        self.client.log_outputs(self.run_id, [LoggedModelOutput(model.model_id, 0)])
        return model.model_id

    def _already_logged(self) -> set[tuple[str, int]]:
        run = self.client.get_run(self.run_id)
        return {
            (key, m.step)
            for key in run.data.metrics
            for m in self.client.get_metric_history(self.run_id, key)
        }

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # a key a mapping's entry makes (multi_turn.envs.game/*) with characters MLflow refuses: as a metric's
        existing = self.client.get_run(self.run_id).data.params
        named = {metric_name(k): v for k, v in params.items()}
        fresh = [Param(k, str(v)[:6000]) for k, v in named.items() if k not in existing]
        for i in range(0, len(fresh), 100):
            self.client.log_batch(self.run_id, params=fresh[i : i + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, metrics: dict[str, float], step: int) -> bool:
        """Queue the metrics at `step` not logged there before, in batches (flush() stores them); False when
        there was none new."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        fresh = {
            metric_name(k): float(v) for k, v in metrics.items() if (metric_name(k), step) not in self._logged
        }
        items = [Metric(k, v, now, step) for k, v in fresh.items()]
        for i in range(0, len(items), 500):
            op = self.client.log_batch(self.run_id, metrics=items[i : i + 500], synchronous=False)
            if op is not None:
                self._pending.append(op)
        self._logged |= {(k, step) for k in fresh}
        return bool(fresh)

    def flush(self) -> None:
        """Wait until every queued metric is stored (raising the error of one that failed)."""
        pending, self._pending = self._pending, []
        for op in pending:
            op.wait()

    def log_summary(
        self, metrics: dict[str, float], model_id: str | None = None, dataset: tuple[str, str] | None = None
    ) -> None:
        """Metrics outside the per-iteration series (final evaluations), logged at step 0 of their own names;
        with `model_id`, linked to that logged model, and with `dataset` (dataset_ref) to the data they were
        measured on (the model page shows each metric beside its dataset)."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        name, digest = dataset or (None, None)
        self.client.log_batch(
            self.run_id,
            metrics=[
                Metric(
                    metric_name(k),
                    float(v),
                    now,
                    0,
                    model_id=model_id,
                    dataset_name=name,
                    dataset_digest=digest,
                )
                for k, v in metrics.items()
            ],
        )

    def log_samples(self, samples: list[dict], iteration: int) -> str:
        """One table of held-out prompts with the model's answers, their ground truths and rewards
        (samples/iter_NNNNNN/answers.json, which the run's Evaluation/Artifacts pages show as a table), and
        each sample's image beside it when it has one (<k>.png); returns the artifact folder.
        `samples`: {row, answer, score}."""
        from components.data.images import open_image
        from components.data.prompts import prompt_text

        folder = f"samples/iter_{iteration:06d}"
        table: dict[str, list] = {"step": [], "prompt": [], "response": [], "ground_truth": [], "reward": []}
        images = []
        for k, s in enumerate(samples):
            row = s["row"]
            if row.get("images"):
                self.client.log_image(
                    self.run_id, open_image(row["images"][0]), artifact_file=f"{folder}/{k}.png"
                )
                images.append(f"{k}.png")
            table["step"].append(iteration)
            table["prompt"].append(prompt_text(row["prompt"]))
            table["response"].append(s["answer"])
            table["ground_truth"].append(str(row["reward_model"]["ground_truth"]))
            table["reward"].append(float(s["score"]))
        if images:  # first: the UI shows each image beside its row
            table = {"image": images, **table}
        self.client.log_table(self.run_id, data=table, artifact_file=f"{folder}/answers.json")
        return folder

    def metric_series(self, names: list[str]) -> dict[str, dict[int, float]]:
        """Each named metric's stored values by step (queued ones first stored); a metric never logged is absent."""
        self.flush()
        series = {}
        for name in names:
            history = self.client.get_metric_history(self.run_id, metric_name(name))
            if history:
                series[name] = {m.step: m.value for m in history}
        return series

    def log_episode_traces(self, episodes: list[dict], iteration: int) -> list[str]:
        """Each sampled multi-turn episode as an MLflow trace of this run (the run's Traces tab): a root span
        with the prompt, a span per turn (the model's text, the tool's result) and the reward. `episodes`:
        {prompt, turns: [(role, text)], reward, ground_truth}. Returns the trace ids."""
        ids = []
        for k, e in enumerate(episodes):
            root = self.client.start_trace(
                f"episode[it={iteration}]",
                span_type="AGENT",
                inputs={"prompt": e["prompt"]},
                attributes={"iteration": str(iteration), "sample": str(k)},
                experiment_id=self.experiment_id,
                run_id=self.run_id,
            )
            for turn, (role, text) in enumerate(e["turns"]):
                span_type = "LLM" if role == "assistant" else "TOOL"
                span = self.client.start_span(
                    f"{role}[{turn}]", root.trace_id, root.span_id, span_type=span_type, inputs={"turn": turn}
                )
                self.client.end_span(root.trace_id, span.span_id, outputs={"text": text})
            self.client.end_trace(
                root.trace_id, outputs={"reward": e["reward"], "ground_truth": e["ground_truth"]}
            )
            ids.append(root.trace_id)
        mlflow.flush_trace_async_logging()
        return ids

    def log_artifacts(self, local_dir: str | Path, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_artifact(self, local_file: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(local_file), artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        """Store the queued metrics and close the run. A failing run closes even if they cannot be stored
        (the error that failed it is the one to report)."""
        if self._system_metrics is not None:
            self._system_metrics.finish()
            self._system_metrics = None
        try:
            self.flush()
        except Exception:
            if status == "FINISHED":
                raise
        finally:
            self.client.set_terminated(self.run_id, status=status)
