"""The multi-turn variant end to end: arith_tool data -> SFT with masked tool output -> GRPO with calculator
calls (its workers in the test's process, trainer.backend=local), tracked in MLflow."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tests.flows.conftest import sft_ready

pytestmark = pytest.mark.slow

TOOL = (
    "data.task=arith_tool",
    "data.tool_sft_fraction=0.5",
    'data.operations=["*"]',
    "engine.max_new_tokens=64",
    "actor.model.max_seq_len=160",
    "multi_turn.enable=true",
    "multi_turn.max_turns=2",
    "data.batch_size=4",
    "reward_model.method=strict",
)


def test_tool_calling_pipeline_runs_and_logs_turns(tmp_path, prefect_harness):
    from flows.train import train_flow

    with sft_ready(tmp_path, iterations=2, extra=TOOL) as ov:
        info = train_flow("configs/arith_grpo.yaml", ov)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    metric = lambda key: [m.value for m in client.get_metric_history(info["run_id"], key)]  # noqa: E731
    turns = metric("num_turns/mean")
    assert len(turns) == 2 and all(1.0 <= t <= 2.0 for t in turns)
    assert len(metric("tool_call_counts/mean")) == 2 and len(metric("tool_errors/mean")) == 2
    assert len(metric("actor/pg_loss")) == 2 and len(metric("val/arith_tool/acc")) == 1
    # the episodes sampled at the evaluation (iteration 2), each a trace of the run: prompt, turns, reward
    traces = client.search_traces(locations=[client.get_run(info["run_id"]).info.experiment_id])
    assert len(traces) == 4 and {t.info.request_metadata["mlflow.sourceRun"] for t in traces} == {
        info["run_id"]
    }
    spans = traces[0].data.spans
    assert spans[0].name == "episode[it=2]" and spans[1].name == "assistant[0]"
    assert {"reward", "ground_truth"} <= spans[0].outputs.keys() and spans[1].outputs["text"]
