"""End to end on the real parts: data -> SFT -> GRPO on Ray -> evaluate, tracked in MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from components.models.loading import load_model
from components.tracking import checkpoints
from tests.flows.conftest import poll, run_dir, scores, sft_ready, small_overrides, task_runs

pytestmark = pytest.mark.slow

ITERATIONS = 4


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, prefect_harness, ray_local):
    from flows.evaluate import evaluate_flow
    from flows.train import train_flow

    root = tmp_path_factory.mktemp("e2e")
    with sft_ready(root, ITERATIONS, backend="ray") as ov:
        info = train_flow("configs/arith_grpo.yaml", ov, "e2e-test", "0.0.1")
        results = evaluate_flow("configs/arith_grpo.yaml", ov, str(root / "metrics" / "eval.json"))
        yield root, info, results


def test_every_parameter_changed(pipeline_run):
    root, info, _ = pipeline_run
    sft = dict(load_model(root / "sft").named_parameters())
    final = dict(load_model(info["final_model"]).named_parameters())
    unchanged = [k for k in sft if torch.equal(sft[k], final[k])]
    assert not unchanged, unchanged


def test_each_iteration_logged_exactly_once(pipeline_run):
    root, info, _ = pipeline_run
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    run = client.get_run(info["run_id"])
    assert run.info.status == "FINISHED"
    for key in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/pg_clipfrac",
        "response_length/mean",
        "timing_s/gen",
        "timing_s/update_actor",
    ):
        steps = sorted(m.step for m in client.get_metric_history(info["run_id"], key))
        assert steps == list(range(1, ITERATIONS + 1)), (key, steps)
    val_steps = sorted(m.step for m in client.get_metric_history(info["run_id"], "val/arith/acc"))
    assert val_steps == [2, 4]
    # the hf engine samples with the policy's own weights: its probabilities are the trainer's, to rounding
    assert run.data.metrics["training/rollout_probs_diff_mean"] < 1e-4
    assert run.data.params["algorithm.name"] == "grpo" and run.data.params["engine.n"] == "4"
    tags = run.data.tags
    assert tags["pipeline"] == "e2e-test" and tags["pipeline_version"] == "0.0.1"
    assert len(tags["dvc.train_md5"]) == 32 and len(tags["mlflow.source.git.commit"]) == 40
    assert "eval/final/acc" in run.data.metrics and "eval/sft/acc" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(info["run_id"])}
    assert {"checkpoints", "reward_curve.png", "run.json"} <= artifacts
    model = client.get_logged_model(info["model_id"])  # the final model: a logged model of its own
    assert model.source_run_id == info["run_id"] and str(model.status) in ("READY", "LoggedModelStatus.READY")
    assert {m.key for m in model.metrics or []} >= {
        "eval/acc",
        "eval/n",
    }  # the evaluation of that exact model
    assert model.tags["reinforge.evaluation"].startswith("linked: eval/* on ")


def test_what_the_mlflow_ui_shows_is_there(pipeline_run):
    """The run page: a name that says what ran, the experiment's kind, the dataset inputs with their DVC md5s,
    a table of sampled completions at each evaluation, and a logged model with a signature."""
    from urllib.parse import urlparse

    import yaml

    root, info, _ = pipeline_run
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    run = client.get_run(info["run_id"])
    assert run.info.run_name.startswith(f"e2e-test-grpo-{info['fingerprint'][:10]}-")
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == (
        "custom_model_development"
    )
    inputs = {[t.value for t in d.tags][0]: d.dataset for d in run.inputs.dataset_inputs}
    assert inputs["train"].digest == run.data.tags["dvc.train_md5"][:36]
    assert json.loads(inputs["train"].profile)["num_rows"] > 0 and "prompt" in inputs["eval"].schema
    tables = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert [t["path"] for t in tables] == [
        "samples/iter_000002/answers.json",
        "samples/iter_000004/answers.json",
    ]
    table = json.loads(
        (root / client.download_artifacts(info["run_id"], tables[0]["path"], str(root))).read_text()
    )
    assert table["columns"][:5] == ["step", "prompt", "response", "ground_truth", "reward"]
    assert len(table["data"]) == 8 and all(r[0] == 2 and r[1] for r in table["data"])
    assert [o.model_id for o in run.outputs.model_outputs] == [info["model_id"]]  # the run page lists it
    model = client.get_logged_model(info["model_id"])
    location = Path(urlparse(model.artifact_location).path)
    assert {"config.json", "model.safetensors"} <= {
        p.name for p in (location / "artifacts" / "final").iterdir()
    }
    mlmodel = yaml.safe_load((location / "MLmodel").read_text())
    assert "python_function" in mlmodel["flavors"]  # a model MLflow loads: pyfunc, from code
    assert json.loads(mlmodel["signature"]["inputs"]) == [
        {"type": "string", "name": "prompt", "required": True}
    ]
    assert model.params["algorithm.name"] == "grpo"  # the run's resolved config, on the model page too
    (metric,) = [m for m in model.metrics if m.key == "eval/acc"]  # measured on the eval dataset
    assert metric.dataset_name == "test" and metric.dataset_digest == run.data.tags["dvc.eval_md5"][:36]


def test_what_the_prefect_ui_shows_is_there(pipeline_run):
    """The flow run: task runs named after their iteration, the per-iteration line in its logs, an artifact
    for each evaluation."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter, LogFilterFlowRunId

    async def read() -> tuple[list, list]:
        async with get_client() as client:
            runs = FlowRunFilter(id={"any_": [flow_run_id]})
            logs = await client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            )
            return logs, await client.read_artifacts(flow_run_filter=runs)

    root, info, _ = pipeline_run
    tags = MlflowClient(f"sqlite:///{root}/mlflow.db").get_run(info["run_id"]).data.tags
    flow_run_id = tags["prefect.flow_run_id"]  # the MLflow run names the Prefect flow run that made it
    expected = {
        f"{s}[it={i}]" for s in ("gen", "reward", "adv", "update-actor") for i in range(1, ITERATIONS + 1)
    }
    assert expected <= task_runs(flow_run_id, expected).keys()
    last_line = f"iter {ITERATIONS}/{ITERATIONS}"

    def has_last_line(read_back) -> bool:
        return any(m.message.startswith(last_line) for m in read_back[0])

    logs, arts = poll(lambda: asyncio.run(read()), has_last_line)  # logs reach the server in batches
    assert has_last_line((logs, arts))
    evaluations = [a for a in arts if a.key == "evaluation"]
    assert len(evaluations) == 2 and "Greedy answers" in evaluations[0].data


def test_checkpoint_reloads_into_an_equal_model(pipeline_run):
    root, info, _ = pipeline_run
    ckpt = checkpoints.latest(run_dir(root / "grpo") / "checkpoints")
    assert ckpt.name == f"iter_{ITERATIONS:06d}"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["weights_version"] == ITERATIONS and state["mlflow_run_id"] == info["run_id"]
    a = load_model(ckpt / "model").state_dict()
    b = load_model(info["final_model"]).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_model_directory_of_the_run_reloads_the_tokenizer_it_was_trained_with(pipeline_run):
    """SFT trained with the in-memory character tokenizer; the SFT model, each checkpoint and the final model
    must give back exactly its ids (spaces and newlines included), or GRPO sees other text than SFT did."""
    from components.models import build_char_tokenizer, load_tokenizer
    from tests.components.models.test_loading import CORPUS

    root, info, _ = pipeline_run
    trained = build_char_tokenizer()
    dirs = [
        root / "sft",
        info["final_model"],
        *(c / "model" for c in (run_dir(root / "grpo") / "checkpoints").glob("iter_*")),
    ]
    for d in dirs:
        loaded = load_tokenizer(d)
        assert [loaded(t, add_special_tokens=False)["input_ids"] for t in CORPUS] == [
            trained(t, add_special_tokens=False)["input_ids"] for t in CORPUS
        ], d


def test_eval_json_has_both_accuracies(pipeline_run):
    root, _, results = pipeline_run
    data = json.loads((root / "metrics" / "eval.json").read_text())
    assert 0 <= data["sft"]["acc"] <= 1 and 0 <= data["final"]["acc"] <= 1
    assert data["iterations"] == ITERATIONS and data == json.loads(json.dumps(results))


def test_the_same_run_with_its_workers_in_this_process_ends_on_the_same_model(pipeline_run):
    """trainer.backend=local (no Ray: the same workers as objects of this process) trains the same model as
    Ray's actors do, bit for bit, and logs the same rewards."""
    from flows.train import train_flow

    root, info, _ = pipeline_run
    local = train_flow(
        "configs/arith_grpo.yaml", small_overrides(root, ITERATIONS) + [f"trainer.output_dir={root}/local"]
    )
    on_ray, here = load_model(info["final_model"]).state_dict(), load_model(local["final_model"]).state_dict()
    assert on_ray.keys() == here.keys() and all(torch.equal(on_ray[k], here[k]) for k in on_ray)
    assert scores(root, local["run_id"]) == scores(root, info["run_id"])  # critic/score/mean, step by step
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    assert client.get_run(local["run_id"]).data.params["trainer.backend"] == "local"


def test_grpo_trains_with_the_tiny_reward_model(pipeline_run):
    """The reward-model path end to end on this run's data and SFT model: train a tiny reward model, then GRPO
    with it mixed into the rule reward, its actor scoring on Ray, all in MLflow."""
    from flows.reward_model import reward_model_flow
    from flows.train import train_flow

    root, _, _ = pipeline_run
    ov = small_overrides(root, 3, "ray") + [f"trainer.output_dir={root}/grpo_rm"]
    fit = reward_model_flow("configs/arith_grpo.yaml", ov, str(root / "rm"), steps=20, batch_size=32, lr=1e-3)
    assert 0.0 <= fit["heldout_pair_accuracy"] <= 1.0
    info = train_flow(
        "configs/arith_grpo.yaml",
        ov
        + [f"reward_model.path={root}/rm", "reward_model.rule_weight=0.5", "reward_model.model_weight=0.5"],
    )
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    history = lambda key: client.get_metric_history(info["run_id"], key)  # noqa: E731
    model, rule = (history(f"reward/{k}/mean") for k in ("model_score", "rule_score"))
    score = history("critic/score/mean")
    assert [m.step for m in model] == [1, 2, 3] and len(rule) == 3
    for m, r, s in zip(model, rule, score):  # critic/score is the weighted mix
        assert s.value == pytest.approx(0.5 * m.value + 0.5 * r.value, abs=1e-5)


def test_the_published_final_model_and_evaluate_output(pipeline_run, tmp_path, capsys):
    """The finished run's final model is also trainer.output_dir/final (what DVC tracks: hard links to the
    run's files, the same bytes), and `reinforge evaluate --model_path ... --output FILE` writes FILE."""
    from flows.evaluate import main

    root, info, _ = pipeline_run
    ov = small_overrides(root, ITERATIONS)
    published, final = root / "grpo" / "final", Path(info["final_model"])
    assert sorted(p.name for p in published.iterdir()) == sorted(p.name for p in final.iterdir())
    assert (published / "model.safetensors").stat().st_ino == (final / "model.safetensors").stat().st_ino
    out = tmp_path / "one.json"
    args = ["--model_path", str(root / "grpo"), "--eval_data", str(root / "clean" / "test.parquet")]
    assert main([*args, "--output", str(out), *ov]) == 0
    written = json.loads(out.read_text())
    assert written["n"] == 16 and 0 <= written["acc"] <= 1 and written["model"] == str(root / "grpo")
    shown = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["acc", str(round(written["acc"], 4))] in shown  # and the summary says it
