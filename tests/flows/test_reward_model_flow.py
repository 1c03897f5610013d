"""The reward-model path end to end: train a tiny reward model, then GRPO with it on Ray, in MLflow."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tests.flows.conftest import sft_ready

pytestmark = pytest.mark.slow


def test_grpo_trains_with_the_tiny_reward_model(tmp_path, prefect_harness, ray_local):
    from flows.reward_model import reward_model_flow
    from flows.train import train_flow

    with sft_ready(tmp_path, iterations=3) as ov:
        fit = reward_model_flow("configs/arith_grpo.yaml", ov, str(tmp_path / "rm"), steps=20, batch_size=32,
                                lr=1e-3)
        assert 0.0 <= fit["heldout_pair_accuracy"] <= 1.0
        info = train_flow("configs/arith_grpo.yaml", ov + [f"reward_model.path={tmp_path}/rm",
                                                            "reward_model.rule_weight=0.5",
                                                            "reward_model.model_weight=0.5"])
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns.db")
    history = lambda key: client.get_metric_history(info["run_id"], key)  # noqa: E731
    model, rule = (history(f"reward/{k}/mean") for k in ("model_score", "rule_score"))
    score = history("critic/score/mean")
    assert [m.step for m in model] == [1, 2, 3] and len(rule) == 3
    for m, r, s in zip(model, rule, score):  # critic/score is the weighted mix
        assert s.value == pytest.approx(0.5 * m.value + 0.5 * r.value, abs=1e-5)
