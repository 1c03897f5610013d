"""A mixture-of-experts policy trains end to end with routing replay (R3): the training flow's loop inside
Prefect, logging to MLflow, the hf engine recording each token's experts and the update replaying them."""

from __future__ import annotations

import math

import pytest
import torch
from mlflow.tracking import MlflowClient

from components.errors import ConfigError
from components.models import build_tiny_model, save_pretrained
from components.models.loading import load_model
from components.validate import load_checked
from tests.flows.local import overrides, run_locally


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("tiny_moe")
    model = build_tiny_model(
        tokenizer,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=96,
        max_positions=64,
        seed=0,
        num_experts=4,
        experts_per_token=2,
    )
    save_pretrained(model, tokenizer, out)
    return out


def test_an_moe_policy_trains_with_its_rollout_routes_replayed(local_root, moe_dir):
    info = run_locally(
        overrides(local_root, "moe", moe_dir, "actor.router_replay=R3", "trainer.iterations=2")
    )
    client = MlflowClient(f"sqlite:///{local_root}/mlflow.db")
    run = client.get_run(info["run_id"])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(info["run_id"], "moe/routing_agreement")
    assert [m.step for m in history] == [1, 2]
    # the engine samples with the trainer's own weights: the routes agree but for float near-ties
    assert all(m.value > 0.99 for m in history), ([m.value for m in history], run.data.metrics)
    metrics = run.data.metrics
    assert metrics["training/rollout_probs_diff_mean"] < 1e-5
    assert not [k for k, v in metrics.items() if not math.isfinite(v)]
    before = load_model(str(moe_dir))
    after = load_model(str(local_root / "moe" / "final"))
    gates = [n for n, _ in after.named_parameters() if n.endswith("mlp.gate.weight")]
    assert gates, "the trained model lost its routers"
    changed = dict(after.named_parameters())
    assert all(not torch.equal(changed[n], dict(before.named_parameters())[n]) for n in gates)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["engine.type=vllm"], "engine.type=vllm does not record the experts"),
        (
            [
                "trainer.partial_rollouts=true",
                "trainer.async_mode=bounded_staleness",
                "trainer.max_staleness=1",
            ],
            "not supported with trainer.partial_rollouts=true",
        ),
    ],
)
def test_replay_refuses_what_cannot_record_or_replay_routes(local_root, moe_dir, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_checked(None, overrides(local_root, "moe_bad", moe_dir, "actor.router_replay=R3", *extra))


def test_replay_refuses_a_dense_policy_naming_the_key(local_root, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"actor\.router_replay=R3: actor\.model\.path=.* is a dense model"):
        load_checked(None, overrides(local_root, "dense", tiny_model_dir, "actor.router_replay=R3"))
