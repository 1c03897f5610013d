"""The engine interface every rollout backend implements, and the registry that picks one by `engine.type`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

from components.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # besides EOS: a sequence ends after sampling one of these


@dataclass
class RolloutOutput:
    """Completions for B prompts x n samples, row i*n + j is sample j of prompt i.

    responses (B*n, R) long, padded with pad_id after EOS; response_mask (B*n, R) 1 on generated tokens
    (EOS included); logprobs (B*n, R) log-probs of the sampled tokens under the temperature-scaled
    distribution, 0 on padding; weights_version: the version of the weights that sampled them.
    """

    responses: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    weights_version: int


class RolloutEngine(Protocol):
    weights_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> RolloutOutput:
        """Sample params.n completions for each prompt (token ids); deterministic for a seed."""

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new policy weights; `version` must grow, so a stale engine is never sampled."""


# engine.type -> "module:Class"; modules are imported only when chosen.
ENGINES = {"hf": "components.rollout.hf:HFEngine"}


def make_engine(engine_type: str, **kwargs) -> RolloutEngine:
    if engine_type not in ENGINES:
        raise ConfigError(f"engine.type={engine_type}: no adapter is built into this version yet; "
                          f"available: {', '.join(sorted(ENGINES))}. Set engine.type=hf.")
    module, cls = ENGINES[engine_type].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
