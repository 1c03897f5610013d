"""`algorithm.name` presets: defaults over the knobs, each overridable key by key.

A preset names only what it changes from BASE; a key the user sets (not None) wins over both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from components.algorithms.advantages import ADVANTAGES
from components.algorithms.losses import AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES
from components.algorithms.rollout_correction import CorrectionParams, check_mode

if TYPE_CHECKING:
    from components.config.schema import AlgorithmConfig

BASE: dict = {
    "adv_estimator": "grpo",
    "loss_agg_mode": "token-mean",
    "norm_adv_by_std": True,
    "policy_loss": "vanilla",
    "gamma": 1.0,
    "lam": 1.0,
    "clip_ratio_high": None,
    "dynamic_sampling": False,
    "overlong_buffer_frac": 0.0,
}

PRESETS: dict[str, dict] = {
    "grpo": {},
    # PPO with a critic: GAE advantages (verl's defaults gamma = lam = 1), actor and critic trained together
    "ppo": {"adv_estimator": "gae"},
    # Dr.GRPO (arXiv 2503.20783): no std division, a constant normaliser instead of the length
    "dr_grpo": {
        "adv_estimator": "dr_grpo",
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "norm_adv_by_std": False,
    },
    # DAPO (arXiv 2503.14476): clip-higher 0.28, token-level loss, dynamic sampling, overlong shaping (20 %)
    "dapo": {"clip_ratio_high": 0.28, "dynamic_sampling": True, "overlong_buffer_frac": 0.2},
    "rloo": {"adv_estimator": "rloo", "norm_adv_by_std": False},
    "reinforce_plus_plus": {"adv_estimator": "reinforce_plus_plus", "norm_adv_by_std": False},
    "reinforce_plus_plus_baseline": {
        "adv_estimator": "reinforce_plus_plus_baseline",
        "norm_adv_by_std": False,
    },
    "remax": {"adv_estimator": "remax", "norm_adv_by_std": False},
    "gspo": {"loss_agg_mode": "seq-mean-token-mean", "policy_loss": "gspo"},
    # SAPO (arXiv 2511.20347): a soft gate in place of the clip, sequence-mean aggregation as the paper
    "sapo": {"loss_agg_mode": "seq-mean-token-mean", "policy_loss": "sapo"},
    # GMPO (arXiv 2507.20673): geometric-mean sequence ratio, log-space clip of 0.4 above (and, by
    # algorithm.clip_epsilon=0.4, below)
    "gmpo": {"loss_agg_mode": "seq-mean-token-mean", "policy_loss": "gmpo", "clip_ratio_high": 0.4},
    # Clip-Cov and KL-Cov (arXiv 2505.22617): entropy kept up by handling the high-covariance tokens
    "clip_cov": {"policy_loss": "clip_cov"},
    "kl_cov": {"policy_loss": "kl_cov"},
    # GPG (arXiv 2504.02546): plain policy gradient, no std division, alpha-corrected group baseline
    "gpg": {"adv_estimator": "gpg", "policy_loss": "gpg", "norm_adv_by_std": False},
    # on-policy distillation: GRPO's knobs, the advantages made by the teacher (distill.*, required)
    "opd": {},
}
PRESETS_NEEDING_A_TEACHER = ("opd",)


@dataclass(frozen=True)
class ResolvedAlgorithm:
    adv_estimator: str
    loss_agg_mode: str
    norm_adv_by_std: bool
    policy_loss: str
    gamma: float
    lam: float
    clip_ratio_high: float  # the upper clip, clip_epsilon when neither the user nor the preset sets it
    dynamic_sampling: bool
    overlong_buffer_frac: float
    kl_loss_type: str
    use_kl_loss: bool  # the KL term is in the actor's loss
    needs_reference: bool  # a frozen reference policy is loaded (KL loss or KL in reward)
    needs_critic: bool  # the estimator needs critic values
    needs_baseline: bool  # the rollout stage samples a greedy baseline completion per prompt
    grouped: bool  # the estimator compares completions of one prompt
    rollout_correction: str = (
        "none"  # algorithm.rollout_correction.mode (components/algorithms/rollout_correction)
    )
    rollout_correction_params: CorrectionParams = CorrectionParams()


def resolve(cfg: AlgorithmConfig) -> ResolvedAlgorithm:
    """Fill the preset's defaults into unset knobs; KeyError (naming the key and valid names) on a bad name."""
    if cfg.name not in PRESETS:
        raise KeyError(
            f"algorithm.name={cfg.name}: unknown preset. Valid names: {', '.join(sorted(PRESETS))}."
        )
    preset = {**BASE, **PRESETS[cfg.name]}
    knobs = {k: getattr(cfg, k) if getattr(cfg, k) is not None else v for k, v in preset.items()}
    if knobs["clip_ratio_high"] is None:
        knobs["clip_ratio_high"] = cfg.clip_epsilon
    info = ADVANTAGES.info(knobs["adv_estimator"])
    AGG_MODES.get(knobs["loss_agg_mode"])
    POLICY_LOSSES.get(knobs["policy_loss"])
    for key, kind in (("kl_loss_type", cfg.kl_loss_type), ("kl_penalty", cfg.kl_penalty)):
        if kind.rstrip("+") not in KL_ESTIMATORS:
            raise KeyError(
                f"algorithm.{key}={kind}: unknown KL estimator. Valid names: "
                f"{', '.join(KL_ESTIMATORS.names())} (add `+` for the straight-through form)."
            )
    rc = cfg.rollout_correction
    if rc.mode != "none":
        check_mode(rc.mode)  # KeyError naming the key and the valid modes
    use_kl_loss = cfg.use_kl_loss if cfg.use_kl_loss is not None else cfg.kl_loss_coef > 0
    use_kl_loss = use_kl_loss and cfg.kl_loss_coef > 0
    return ResolvedAlgorithm(
        **knobs,
        kl_loss_type=cfg.kl_loss_type,
        use_kl_loss=use_kl_loss,
        needs_reference=use_kl_loss or cfg.use_kl_in_reward,
        needs_critic=bool(info.get("needs_values")),
        needs_baseline=bool(info.get("needs_baseline")),
        grouped=bool(info.get("grouped")),
        rollout_correction=rc.mode,
        rollout_correction_params=CorrectionParams(
            rc.cap, rc.band_low, rc.band_high, rc.geo_low, rc.geo_high, rc.offpolicy_threshold
        ),
    )
