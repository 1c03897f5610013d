"""Model registry: a model is registered only if it beats every registered version."""

import mlflow
from mlflow.tracking import MlflowClient

from components.tracking.mlflow_tracker import Tracker, metric_name
from components.tracking.registry import register_if_better


def test_register_only_when_better(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    runs = []
    for _ in range(3):
        t = Tracker("reg-test", "r")
        t.log_artifacts(tmp_path / "model", "final_model")
        t.end()
        runs.append(t.run_id)
    first = register_if_better("m", runs[0], "final_model", 0.5)
    worse = register_if_better("m", runs[1], "final_model", 0.4)
    better = register_if_better("m", runs[2], "final_model", 0.7)
    assert first["registered"] and not worse["registered"] and "does not beat" in worse["reason"]
    assert better["registered"] and better["previous_best"] == 0.5
    versions = MlflowClient(f"sqlite:///{tmp_path}/m.db").search_model_versions("name='m'")
    assert sorted(v.run_id for v in versions) == sorted([runs[0], runs[2]])
    mlflow.set_tracking_uri(None)


def test_steps_are_logged_once_and_names_sanitised(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    t = Tracker("steps", "r")
    assert t.log_metrics({"val/arith/acc_mean@4": 0.5}, 1)
    assert not t.log_metrics({"val/arith/acc_mean@4": 0.9}, 1)  # a second log of step 1 is refused
    t.flush()  # metrics are queued; a run is resumed after its checkpoint, which flushes them first
    resumed = Tracker("steps", "r", run_id=t.run_id)  # a resumed run knows which (metric, step) it has
    assert not resumed.log_metrics({"val/arith/acc_mean@4": 0.7}, 1)
    assert resumed.log_metrics({"x": 1.0}, 1) and resumed.log_metrics({"x": 1.0}, 2)
    assert not resumed.log_metrics({"x": 3.0}, 2)
    resumed.flush()
    hist = resumed.client.get_metric_history(t.run_id, "val/arith/acc_mean_at_4")
    assert [(m.step, m.value) for m in hist] == [(1, 0.5)]
    assert metric_name("a@b:c") == "a_at_b_c"
