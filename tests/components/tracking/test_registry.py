"""Model registry: versions are logged models no later run can change; aliases say which version serves."""

import hashlib

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from components.models import build_char_tokenizer, save_pretrained
from components.tracking.mlflow_tracker import Tracker, metric_name
from components.tracking.registry import (
    CHALLENGER,
    CHAMPION,
    PromotionRefused,
    Recorded,
    decide,
    download_version,
    find_champion,
    register_candidate,
)
from tests.conftest import make_model


@pytest.fixture()
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/m.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    yield MlflowClient(uri, registry_uri=uri)
    mlflow.set_tracking_uri(None)
    mlflow.set_registry_uri(None)


def digests(directory) -> dict[str, str]:
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def logged(tmp_path, seed: int) -> tuple[str, str]:
    """A run that saved its final model to run/final and logged it; (run id, model id)."""
    tok = build_char_tokenizer()
    final = save_pretrained(make_model(tok, seed=seed), tok, tmp_path / "run" / "final")
    tracker = Tracker("reg-test", f"r{seed}")
    model_id = tracker.log_model(final, "final_model")
    tracker.end()
    return tracker.run_id, model_id


def greedy(path) -> list[str]:
    from components.rollout.worker import RolloutWorker
    from components.settings import SamplingParams
    from tests.conftest import arith_rows

    worker = RolloutWorker(str(path))
    rows = arith_rows(6)
    return worker.decode(worker.generate(rows, SamplingParams(n=1, temperature=0.0, max_new_tokens=6), 0, -1))


def test_a_registered_version_never_changes_when_its_run_is_overwritten(tmp_path, store):
    run_id, model_id = logged(tmp_path, seed=0)
    registered = digests(tmp_path / "run" / "final")
    answers = greedy(tmp_path / "run" / "final")
    v1 = register_candidate("m", model_id, run_id, 0.5, "set-a", measure=lambda v: pytest.fail("not needed"))
    assert v1["version"] == "1" and v1["alias"] == CHAMPION
    logged(tmp_path, seed=1)  # a later run (a resumed nightly) writes a new final model in the same place
    assert digests(tmp_path / "run" / "final") != registered
    files = download_version("m", "1", tmp_path / "from_registry")
    assert digests(files) == registered  # the same files as registered
    assert greedy(files) == answers  # and so the same outputs, so the same accuracy
    version = store.get_model_version("m", "1")
    assert version.source == f"models:/{model_id}" and version.tags["eval_acc"] == "0.5"


def test_the_registered_champion_loads_with_mlflow_pyfunc_and_generates(tmp_path, store):
    """The logged model is a pyfunc model MLflow itself loads (no flavor-less MLmodel): the champion alias,
    prompts in a DataFrame, the model's own greedy completions out; its signature names prompt, completion and
    the sampling params, and it ships an input example."""
    import pandas as pd
    from mlflow.models import Model

    from tests.conftest import arith_rows

    run_id, model_id = logged(tmp_path, seed=0)
    register_candidate("m", model_id, run_id, 0.5, "set-a", measure=lambda v: pytest.fail("not needed"))
    model = mlflow.pyfunc.load_model("models:/m@champion")
    prompts = [r["prompt"] for r in arith_rows(6)]
    out = model.predict(pd.DataFrame({"prompt": prompts}), params={"max_new_tokens": 6})
    assert list(out["completion"]) == greedy(tmp_path / "run" / "final")
    meta = Model.load(
        mlflow.artifacts.download_artifacts(f"models:/{model_id}", dst_path=str(tmp_path / "m"))
    )
    assert "python_function" in meta.flavors and meta.saved_input_example_info
    assert meta.signature.inputs.input_names() == ["prompt"]
    assert [p.name for p in meta.signature.params] == ["max_new_tokens", "temperature", "seed"]
    assert (
        store.get_logged_model(model_id).params == {}
    )  # this test's run logged none; a real run's are its config


def test_promotion_by_alias_on_the_same_evaluation_set(tmp_path, store):
    ids = [logged(tmp_path / str(i), seed=i) for i in range(4)]
    measured = []

    def measure(version):
        measured.append(version)
        return 0.55

    register_candidate("m", ids[0][1], ids[0][0], 0.6, "set-a", measure)
    lost = register_candidate("m", ids[1][1], ids[1][0], 0.58, "set-a", measure)
    assert (
        lost["alias"] == CHALLENGER and lost["champion_acc"] == 0.6 and not measured
    )  # same set: its figure
    won = register_candidate("m", ids[2][1], ids[2][0], 0.7, "set-a", measure)
    assert won["alias"] == CHAMPION and "beats the champion's 0.6000" in won["reason"]
    other_set = register_candidate("m", ids[3][1], ids[3][0], 0.6, "set-b", measure)
    # the champion's 0.7 was measured on set-a: it is measured again on set-b (0.55) before deciding
    assert measured == ["3"] and other_set["alias"] == CHAMPION and other_set["champion_acc_measured_now"]
    assert str(store.get_model_version_by_alias("m", CHAMPION).version) == "4"
    assert str(store.get_model_version_by_alias("m", CHALLENGER).version) == "2"
    assert store.get_model_version("m", "4").tags["decision.champion_acc"] == "0.55"


def test_steps_are_logged_once_and_names_sanitised(tmp_path, store):
    t = Tracker("steps", "r")
    assert t.log_metrics({"val/arith/acc_mean@4": 0.5}, 1)
    assert not t.log_metrics({"val/arith/acc_mean@4": 0.9}, 1)  # a second log of step 1 is refused
    t.flush()  # metrics are queued; a run is resumed after its checkpoint, which flushes them first
    resumed = Tracker("steps", "r", run_id=t.run_id)  # a resumed run knows which (metric, step) it has
    assert resumed.resumed and not resumed.log_metrics({"val/arith/acc_mean@4": 0.7}, 1)
    assert resumed.log_metrics({"x": 1.0}, 1) and resumed.log_metrics({"x": 1.0}, 2)
    assert not resumed.log_metrics({"x": 3.0}, 2)
    resumed.flush()
    hist = resumed.client.get_metric_history(t.run_id, "val/arith/acc_mean_at_4")
    assert [(m.step, m.value) for m in hist] == [(1, 0.5)]
    assert metric_name("a@b:c") == "a_at_b_c"
    # a mapping's entry as a param (multi_turn.envs.game/*: textarena), logged once across a resume
    resumed.log_params({"multi_turn.envs.game/*": "textarena", "trainer.seed": 0})
    Tracker("steps", "r", run_id=t.run_id).log_params({"multi_turn.envs.game/*": "textarena"})
    params = resumed.client.get_run(t.run_id).data.params
    assert params == {"multi_turn.envs.game/_": "textarena", "trainer.seed": "0"}


def test_a_run_missing_from_the_tracking_store_starts_a_new_one(tmp_path, store):
    fresh = Tracker("steps", "r", run_id="0123456789abcdef0123456789abcdef")
    assert not fresh.resumed and fresh.run_id != "0123456789abcdef0123456789abcdef"
    assert store.get_run(fresh.run_id).info.status == "RUNNING"


NAN, INF = float("nan"), float("inf")


def rec(version: int, acc: float | None, eval_set: str = "a") -> Recorded:
    return Recorded(str(version), acc, eval_set)


@pytest.mark.parametrize(
    ("alias", "versions", "champion", "how"),
    [
        # the alias's version, with a finite metric: it is the champion
        ("2", [rec(1, 0.9), rec(2, 0.5)], "2", "the champion alias"),
        # no versions: nothing to beat
        (None, [], None, "no version holds the champion alias"),
        # no alias, versions recorded: the best finite one (a NaN is never a champion)
        (None, [rec(1, 0.4), rec(2, NAN), rec(3, 0.6)], "3", "recovered as version 3"),
        # the alias on a deleted version: the best of those left
        ("9", [rec(1, 0.4), rec(2, 0.7), rec(3, 0.6)], "2", "version 9, which no longer exists"),
        # the alias on a NaN champion (registered before the gate refused them): recovered past it
        ("2", [rec(1, 0.4), rec(2, NAN)], "1", "has no finite recorded eval_acc (nan)"),
        # an infinite or unreadable metric is as invalid as a NaN
        (None, [rec(1, INF), rec(2, None), rec(3, 0.1)], "3", "recovered as version 3"),
        # equal metrics: the earliest, which the later one did not beat
        (None, [rec(1, 0.5), rec(2, 0.5)], "1", "recovered as version 1"),
        # the same evaluation set is preferred over a better figure on another
        (None, [rec(1, 0.9, "b"), rec(2, 0.5, "a")], "2", "recovered as version 2"),
        # only other sets: the best of them (measured again on this set by the caller)
        (None, [rec(1, 0.9, "b"), rec(2, 0.5, "c")], "1", "recovered as version 1"),
        # no alias and nothing finite: no champion (the candidate is the first valid one)
        (None, [rec(1, NAN)], None, "no version has a finite recorded eval_acc"),
    ],
)
def test_the_champion_is_found_or_recovered_from_the_recorded_versions(alias, versions, champion, how):
    found, why = find_champion("m", alias, versions, "a")
    assert (found.version if found else None) == champion
    assert how in why


def test_a_dangling_alias_with_nothing_finite_to_recover_from_is_refused_in_one_line():
    with pytest.raises(PromotionRefused) as err:
        find_champion("m", "7", [rec(1, NAN), rec(2, None)], "a")
    message = str(err.value)
    assert "\n" not in message and "version 7, which no longer exists" in message
    assert "set_registered_model_alias('m', 'champion', <version>)" in message


@pytest.mark.parametrize(
    ("acc", "champ", "champ_acc", "alias", "reason"),
    [
        (NAN, None, None, CHALLENGER, "nan: a non-finite metric never promotes"),
        (INF, rec(1, 0.5), 0.5, CHALLENGER, "inf: a non-finite metric never promotes"),
        (-INF, rec(1, 0.5), 0.5, CHALLENGER, "a non-finite metric never promotes"),
        (0.3, None, None, CHAMPION, "the first version with a finite metric"),
        (0.6, rec(1, 0.5), 0.5, CHAMPION, "acc 0.6000 beats the champion's 0.5000"),
        (0.5, rec(1, 0.5), 0.5, CHALLENGER, "acc 0.5000 does not beat the champion's 0.5000"),
        (0.4, rec(1, 0.5), 0.5, CHALLENGER, "does not beat"),
        # a champion measured now on this set as NaN is beaten by any finite figure
        (0.0, rec(1, 0.9, "b"), NAN, CHAMPION, "beats the champion's nan"),
    ],
)
def test_the_gate_decides_each_case(acc, champ, champ_acc, alias, reason):
    decision = decide(acc, champ, champ_acc, "how", champ.version if champ else None)  # the alias's
    assert decision["alias"] == alias and reason in decision["reason"]


def test_a_nan_candidate_and_a_deleted_champion_never_promote_the_wrong_model(tmp_path, store):
    """Through MLflow's registry: a NaN candidate stays a challenger; with the champion's version deleted by
    hand, the next candidate is compared with the best version left, not promoted as the first one."""
    ids = [logged(tmp_path / str(i), seed=i) for i in range(5)]

    def measure(version):
        raise AssertionError("every version was measured on this set")

    register_candidate("m", ids[0][1], ids[0][0], 0.8, "set-a", measure)  # v1 champion
    nan = register_candidate("m", ids[1][1], ids[1][0], NAN, "set-a", measure)  # v2
    assert nan["alias"] == CHALLENGER and "never promotes" in nan["reason"]
    assert str(store.get_model_version_by_alias("m", CHAMPION).version) == "1"
    register_candidate("m", ids[2][1], ids[2][0], 0.9, "set-a", measure)  # v3 champion
    store.delete_model_version("m", "3")  # by hand: the alias goes with it, or dangles
    worse = register_candidate("m", ids[3][1], ids[3][0], 0.5, "set-a", measure)  # v4
    assert worse["alias"] == CHALLENGER and worse["champion_version"] == "1"
    assert "recovered as version 1" in store.get_model_version("m", "4").tags["decision.champion_found"]
    assert str(store.get_model_version_by_alias("m", CHAMPION).version) == "1"  # the alias serves v1 again
    better = register_candidate("m", ids[4][1], ids[4][0], 0.85, "set-a", measure)  # v5
    assert better["alias"] == CHAMPION and better["champion_acc"] == 0.8
    assert str(store.get_model_version_by_alias("m", CHAMPION).version) == "5"


def test_a_recovered_champion_that_keeps_its_title_takes_the_alias_back():
    recovered = (
        "no version holds the champion alias; recovered as version 2, the best finite recorded eval_acc"
    )
    kept = decide(0.4, rec(2, 0.5), 0.5, recovered, None)
    assert kept["alias"] == CHALLENGER and kept["restore_champion"] == "2"
    assert "restore_champion" not in decide(
        0.6, rec(2, 0.5), 0.5, recovered, None
    )  # beaten: the candidate has it
    assert "restore_champion" not in decide(0.4, rec(2, 0.5), 0.5, "the champion alias", "2")  # never lost it
    assert decide(NAN, rec(2, 0.5), 0.5, recovered, "7")["restore_champion"] == "2"  # the alias dangled
