"""Seed every RNG (python, numpy, torch) and derive per-use seeds from (seed, iteration, purpose)."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derive_seed(*parts) -> int:
    """A stable 63-bit seed from any parts, e.g. derive_seed(seed, iteration, "rollout")."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
