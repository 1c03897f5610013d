"""`algorithm.name` presets: defaults over the knobs, each overridable key by key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from components.algorithms.advantages import ADVANTAGES
from components.algorithms.losses import AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES

if TYPE_CHECKING:
    from components.config.schema import AlgorithmConfig

PRESETS: dict[str, dict] = {
    "grpo": {"adv_estimator": "grpo", "loss_agg_mode": "token-mean", "norm_adv_by_std": True},
    "dr_grpo": {"adv_estimator": "grpo", "loss_agg_mode": "seq-mean-token-sum-norm", "norm_adv_by_std": False},
    "rloo": {"adv_estimator": "rloo", "loss_agg_mode": "token-mean", "norm_adv_by_std": False},
    "gspo": {"adv_estimator": "grpo", "loss_agg_mode": "seq-mean-token-mean", "norm_adv_by_std": True,
             "policy_loss": "gspo"},
    "reinforce_plus_plus": {"adv_estimator": "reinforce_plus_plus", "loss_agg_mode": "token-mean",
                            "norm_adv_by_std": False},
    "reinforce_plus_plus_baseline": {"adv_estimator": "reinforce_plus_plus_baseline",
                                     "loss_agg_mode": "token-mean", "norm_adv_by_std": False},
}


@dataclass(frozen=True)
class ResolvedAlgorithm:
    adv_estimator: str
    loss_agg_mode: str
    norm_adv_by_std: bool
    policy_loss: str
    kl_loss_type: str


def resolve(cfg: "AlgorithmConfig") -> ResolvedAlgorithm:
    """Fill the preset's defaults into unset knobs; KeyError (naming the key and valid names) on a bad name."""
    if cfg.name not in PRESETS:
        raise KeyError(f"algorithm.name={cfg.name}: unknown preset. Valid names: {', '.join(sorted(PRESETS))}.")
    base = PRESETS[cfg.name]
    pick = lambda key: getattr(cfg, key) if getattr(cfg, key) is not None else base[key]  # noqa: E731
    policy_loss = cfg.policy_loss or base.get("policy_loss", "vanilla")
    out = ResolvedAlgorithm(pick("adv_estimator"), pick("loss_agg_mode"), pick("norm_adv_by_std"), policy_loss,
                            cfg.kl_loss_type)
    ADVANTAGES.get(out.adv_estimator)
    AGG_MODES.get(out.loss_agg_mode)
    POLICY_LOSSES.get(out.policy_loss)
    KL_ESTIMATORS.get(out.kl_loss_type.rstrip("+"))
    return out
