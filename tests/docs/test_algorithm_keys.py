"""docs/algorithms.md lists every key of the algorithm library's 2026 round (losses, mismatch masks,
distillation, MoE routing) with its default, and the reference config (`reinforge config generate`) has them
all: a key a user cannot find is a feature they cannot use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from components.config import load_config
from components.config.loader import flatten
from components.reference import reference_config

ROOT = Path(__file__).resolve().parents[2]
KEYS = [
    "algorithm.sapo_tau_pos",
    "algorithm.sapo_tau_neg",
    "algorithm.clip_cov_ratio",
    "algorithm.clip_cov_lb",
    "algorithm.clip_cov_ub",
    "algorithm.kl_cov_ratio",
    "algorithm.kl_cov_coef",
    "algorithm.rollout_correction.band_low",
    "algorithm.rollout_correction.band_high",
    "algorithm.rollout_correction.geo_low",
    "algorithm.rollout_correction.geo_high",
    "algorithm.rollout_correction.offpolicy_threshold",
    "distill.teacher_path",
    "distill.coef",
    "distill.task_coef",
    "distill.loss",
    "distill.jsd_beta",
    "distill.placement",
    "actor.router_replay",
    "sft.num_experts",
    "sft.experts_per_token",
]


def _stated(text: str, default) -> bool:
    """Whether `text` states the value `default` (2e-4 and 0.0002 alike)."""
    if default is None:
        return "null" in text
    if isinstance(default, str):
        return f"`{default}`" in text or default in text
    return any(float(n) == float(default) for n in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", text))


@pytest.mark.parametrize("key", KEYS)
def test_each_new_key_is_documented_with_its_default(key):
    default = flatten(load_config(None, []))[key]
    doc = (ROOT / "docs" / "algorithms.md").read_text()
    leaf = key.rsplit(".", 1)[-1]
    places = [m.start() for m in re.finditer(re.escape(f"`{key}") + "|" + re.escape(f"`{leaf}`"), doc)]
    assert places, f"{key} is not in docs/algorithms.md"
    assert any(_stated(doc[at : at + 60], default) for at in places), (key, default)
    assert f"\n{'  ' * key.count('.')}{leaf}: " in reference_config(), key
