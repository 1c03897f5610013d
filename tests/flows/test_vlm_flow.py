"""The multimodal pipeline end to end on real Prefect and MLflow: counting images -> clean -> SFT of a composed
VLM -> GRPO with pixel inputs -> MLflow metrics and sample images; resume from a checkpoint is exact. Its workers
run in the test's process (trainer.backend=local): a batch's pixel_values reach Ray's actors as any other
tensor of it does (the text pipeline's end-to-end test on Ray, tests/flows/test_train_flow.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from components.models.loading import load_image_encoder, load_model, load_tokenizer
from tests.flows.conftest import run_dir, sft_ready

pytestmark = pytest.mark.slow

CONFIG = "configs/vlm_grpo.yaml"
ITERATIONS = 4
SMALL = (
    "data.num_train=64",
    "data.num_eval=8",
    "data.max_prompt_len=32",
    "actor.model.max_seq_len=64",
    "sft.steps=10",
    "trainer.save_interval=1",
)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, prefect_harness):
    from flows.train import train_flow

    root = tmp_path_factory.mktemp("vlm")
    with sft_ready(root, ITERATIONS, SMALL, CONFIG) as ov:
        whole = train_flow(CONFIG, ov)
        yield root, ov, whole


def test_the_vlm_pipeline_logs_vision_metrics_and_sample_images(vlm):
    root, _, whole = vlm
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    metric = lambda key: [m.value for m in client.get_metric_history(whole["run_id"], key)]  # noqa: E731
    assert metric("vision/image_tokens_per_sample") == [16.0] * ITERATIONS  # 4x4 patches, 1/4 of 64 tokens
    assert metric("vision/frozen") == [0.0] * ITERATIONS and len(metric("actor/pg_loss")) == ITERATIONS
    assert len(metric("val/visual_count/acc")) == 2  # test_interval 2 of 4 iterations
    local = client.download_artifacts(whole["run_id"], "samples/iter_000004", str(root / "dl"))
    table = json.loads((Path(local) / "answers.json").read_text())
    assert table["columns"][:4] == ["image", "step", "prompt", "response"] and len(table["data"]) == 8
    assert all((root / "dl" / "iter_000004" / row[0]).is_file() for row in table["data"])
    final = whole["final_model"]
    model = load_model(final)
    assert type(model).__name__ == "VisionLanguageModel"
    assert load_image_encoder(final, load_tokenizer(final)).image_tokens == 16


def test_a_resume_from_a_checkpoint_with_images_ends_equal_to_the_whole_run(vlm):
    """Restarted from iteration 2's checkpoint in another output directory: weights, optimizer, RNG and
    sampler state continue exactly, so the final model is the uninterrupted run's to the bit."""
    from flows.train import train_flow

    root, ov, whole = vlm
    ckpt = run_dir(root / "grpo") / "checkpoints" / "iter_000002"
    resumed = train_flow(CONFIG, ov + [f"trainer.output_dir={root}/resumed", f"trainer.resume_mode={ckpt}"])
    a, b = load_model(whole["final_model"]).state_dict(), load_model(resumed["final_model"]).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_with_a_critic_trains_on_images_and_a_frozen_tower_stays_bit_identical(vlm):
    """PPO (GAE) with actor.model.freeze_vision_model=true on the Ray policy worker: the critic reads the VLM's
    hidden states with the images (a finite value loss every iteration); after RL every vision parameter
    equals the SFT model's while the projector moved; MLflow says the tower was frozen."""
    from components.models.vlm import vision_parameter
    from flows.train import train_flow

    root, ov, _ = vlm
    info = train_flow(
        CONFIG,
        ov
        + [
            f"trainer.output_dir={root}/ppo",
            "algorithm.name=ppo",
            "actor.model.freeze_vision_model=true",
            "trainer.iterations=2",
        ],
    )
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    metric = lambda key: [m.value for m in client.get_metric_history(info["run_id"], key)]  # noqa: E731
    vf = metric("critic/vf_loss")
    assert len(vf) == 2 and all(v == v for v in vf)
    assert metric("vision/frozen") == [1.0, 1.0]
    before, after = load_model(root / "sft").state_dict(), load_model(info["final_model"]).state_dict()
    vision = [k for k in before if vision_parameter(k)]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("projector."))
