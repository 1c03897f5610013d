"""Our GRPO / Dr.GRPO / DAPO losses against TRL's own `GRPOTrainer._compute_loss` on the same random tensors.

TRL (dev extra only) is an independent implementation: its loss method runs unchanged on a trainer object
that holds only the attributes the method reads, with the model's log-probs replaced by our tensors.
Mapping: TRL loss_type grpo = our seq-mean-token-mean, dr_grpo = seq-mean-token-sum-norm with the max
completion length as the constant, dapo = token-mean; TRL's KL term is k3 (our low_var_kl) times beta.
"""

from types import SimpleNamespace

import pytest
import torch

from components.algorithms.losses import AggParams, agg_loss, kl_penalty, vanilla_ppo
from components.settings import PolicyLossParams

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL comes with the dev extra")

B, T = 6, 7
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04
MODES = {"grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm", "dapo": "token-mean"}


def random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g)  # ratios well inside and outside the clip
    ref = logp.detach() + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return logp, old, ref, adv, mask


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(loss_type: str, logp, old, ref, adv, mask) -> torch.Tensor:
    from collections import defaultdict

    trainer = object.__new__(grpo_trainer.GRPOTrainer)
    attrs = dict(
        loss_type=loss_type,
        beta=BETA,
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        importance_sampling_level="token",
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        max_completion_length=T,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        use_adaptive_entropy=False,
        current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    for k, v in attrs.items():
        object.__setattr__(trainer, k, v)
    object.__setattr__(
        trainer, "_get_per_token_logps_and_entropies", lambda *a, **kw: (logp, torch.zeros_like(logp), None)
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    return trainer._compute_loss(None, inputs)


def our_loss(loss_type: str, logp, old, ref, adv, mask) -> torch.Tensor:
    mode = MODES[loss_type]
    m = mask.float()
    agg = AggParams(num_tokens=float(m.sum()), num_seqs=float(B), norm_const=float(T))
    params = PolicyLossParams(clip_low=EPS_LOW, clip_high=EPS_HIGH, clip_ratio_c=1e9, agg_mode=mode)
    pg, _ = vanilla_ppo(logp, old, adv[:, None].expand(B, T), m, params, agg)
    return pg + BETA * agg_loss(kl_penalty(logp, ref, "low_var_kl"), m, mode, agg)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_equal_trl(loss_type, seed):
    logp, old, ref, adv, mask = random_case(seed)
    theirs = trl_loss(loss_type, logp, old, ref, adv, mask)
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    ours = our_loss(loss_type, logp, old, ref, adv, mask)
    (g_ours,) = torch.autograd.grad(ours, logp)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    torch.testing.assert_close(g_ours, g_theirs, atol=1e-6, rtol=0)
