"""Every `algorithm.name` preset runs the training flow's loop (flows/train.py, on workers in this process,
inside Prefect, logging to MLflow) for an iteration without NaN, and logs its algorithm's own metrics. The
loop on Ray workers runs end to end in test_train_flow.py."""

from __future__ import annotations

import math

import pytest
from mlflow.tracking import MlflowClient

from components.algorithms.presets import PRESETS
from tests.flows.local import overrides, run_locally

ITERATIONS = 1  # each preset's own path runs in its first iteration
OWN_METRICS = {
    "ppo": [
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vf_explained_var",
        "critic/values/mean",
        "actor/reward_kl_penalty",
        "actor/reward_kl_penalty_coeff",
        "timing_s/values",
        "timing_s/update_critic",
    ],
    "dapo": ["dynamic_sampling/groups_kept", "dynamic_sampling/gen_rounds", "reward/overlong_penalty_mean"],
    "remax": ["reward/greedy_baseline_mean"],
    "grpo": ["actor/kl_loss", "actor/kl_coef"],
    "rloo": [
        "rollout_corr/weight_mean",
        "rollout_corr/weight_max",
        "rollout_corr/changed_frac",
        "rollout_corr/seq_weight_mean",
    ],
    "sapo": [
        "rollout_corr/icepop_frac",
        "rollout_corr/geo_mis_frac",
        "rollout_corr/offpolicy_mask_frac",
        "rollout_corr/seq_masked_frac",
    ],
    "opd": ["distill/reverse_kl", "distill/teacher_logprob"],
}
EXTRA = {  # exercise the KL paths too: in the reward (adaptive) with PPO, in the loss with GRPO
    "ppo": [
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl=adaptive",
        "actor.ppo_mini_batch_size=16",
        "actor.ppo_epochs=2",
    ],
    "grpo": ["algorithm.kl_loss_coef=0.04"],
    "rloo": ["algorithm.rollout_correction.mode=tis"],  # engine vs trainer correction, in a sync run
    "sapo": ["algorithm.rollout_correction.mode=icepop+geo_mis+offpolicy_mask"],  # the masks, combined
    "opd": ["distill.teacher_path={model}"],  # the policy's own directory teaches it: the KL is 0
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_trains_without_nan(local_root, tiny_model_dir, preset):
    root = local_root
    own = [e.format(model=tiny_model_dir) for e in EXTRA.get(preset, [])]
    extra = [f"algorithm.name={preset}", f"trainer.iterations={ITERATIONS}", *own]
    info = run_locally(overrides(root, preset, tiny_model_dir, *extra))
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    run = client.get_run(info["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["algorithm.name"] == preset
    metrics = run.data.metrics
    assert not [k for k, v in metrics.items() if not math.isfinite(v)]
    for key in [
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "critic/advantages/mean",
        "critic/advantages/max",
        "critic/advantages/min",
        "critic/returns/mean",
        "reward/invalid_count",
    ] + OWN_METRICS.get(preset, []):
        steps = sorted(m.step for m in client.get_metric_history(info["run_id"], key))
        assert steps == list(range(1, ITERATIONS + 1)), (key, steps)
    if "rollout_corr/weight_mean" in metrics:  # the hf engine samples with the trainer's own weights: w = 1
        assert (
            abs(metrics["rollout_corr/weight_mean"] - 1) < 1e-4 and metrics["rollout_corr/changed_frac"] == 0
        )
