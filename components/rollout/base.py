"""The engine interface every rollout backend implements, and the registry that picks one by `engine.type`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

from components.errors import ConfigError
from components.settings import SamplingParams


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
    # (B*n,) bool: samples stopped before their end because the caller asked (`interrupt`), None if none was
    unfinished: torch.Tensor | None = None
    # an MoE policy's routes (B*n, P + R, L, k) int16: the experts each prompt and response position took in
    # each MoE layer (components/models/moe.py), -1 where nothing was fed (the last sampled token); else None
    routes: torch.Tensor | None = None


@dataclass(frozen=True)
class PromptImages:
    """A VLM prompt batch's images in the two forms engines take: `pixels` (B, C, H, W) after the policy's
    image processor (the hf engine feeds them to the model, as the trainer does), and `raw`, one PIL image (or
    None) per prompt, for engines that run the model's processor themselves (vLLM, SGLang). Those expand the
    image placeholder `token_id` themselves, so they are given each prompt `collapsed` to one placeholder per
    image (our prompts carry it expanded to the image's tokens, as the trainer scores them)."""

    pixels: torch.Tensor
    raw: list
    token_id: int

    def collapsed(self, ids: list[int]) -> list[int]:
        """A run of image tokens as the one placeholder the user wrote.

        >>> PromptImages(torch.zeros(1), [None], 9).collapsed([1, 9, 9, 9, 2, 9, 9])
        [1, 9, 2, 9]
        """
        return [t for i, t in enumerate(ids) if t != self.token_id or i == 0 or ids[i - 1] != t]


class RolloutEngine(Protocol):
    """Built by `make_engine`; GPU engines may also free their memory between rollouts (`sleep` / `wake`)."""

    weights_version: int

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int, images: PromptImages | None = None
    ) -> RolloutOutput:
        """Sample params.n completions for each prompt (token ids, with a VLM's `images`); deterministic for
        a seed. The engines in completions.INTERRUPTIBLE_ENGINES also take `interrupt`, a callable asked
        between their steps: when it answers true they stop, the samples cut short marked `unfinished`."""

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new policy weights; `version` must grow, so a stale engine is never sampled."""


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) ids and attention mask, left-padded so every prompt ends at the last column."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def check_newer(current: int, version: int) -> None:
    """Weights only move forward: loading an older version than the engine holds is refused.

    >>> check_newer(3, 2)
    Traceback (most recent call last):
    ...
    ValueError: weights version 2 is older than the engine's 3
    """
    if version < current:
        raise ValueError(f"weights version {version} is older than the engine's {current}")


# engine.type -> "module:Class"; modules (and their packages) are imported only when chosen.
ENGINES = {
    "hf": "components.rollout.hf:HFEngine",
    "vllm": "components.rollout.vllm_engine:VLLMEngine",
    "sglang": "components.rollout.sglang_engine:SGLangEngine",
    "trtllm": "components.rollout.trtllm_engine:TRTLLMEngine",
}


def make_engine(
    engine_type: str,
    path: str,
    eos_id: int,
    pad_id: int,
    options=None,
    model=None,
    key: str = "actor.model.path",
) -> RolloutEngine:
    """The engine for `engine.type`, over the model at `path` (the hf engine can take a loaded `model`, a
    colocated policy's own module). A missing package raises ConfigError with its install command."""
    from components.settings import EngineOptions

    if engine_type not in ENGINES:
        raise ConfigError(f"engine.type={engine_type}: unknown; available: {', '.join(sorted(ENGINES))}.")
    module, cls = ENGINES[engine_type].split(":")
    engine_cls = getattr(importlib.import_module(module), cls)
    options = options or EngineOptions()
    if hasattr(engine_cls, "from_path"):  # engines that can also sample with an already loaded module
        return engine_cls.from_path(path, eos_id, pad_id, options, model=model, key=key)
    return engine_cls(path, eos_id, pad_id, options)


def continue_samples(
    out: RolloutOutput, rows: torch.Tensor, more: RolloutOutput, pad_id: int
) -> RolloutOutput:
    """`out` with its samples `rows` (cut short: each has no stop token, so its mask covers its tokens so far)
    continued by `more` (one sample per row, in order), each right after its own last token (an engine that
    batches continuously may cut samples at different lengths): tokens, masks and log-probs, the other
    samples padded. The version stays `out`'s (the one the samples began with); `unfinished` is `out`'s for
    the other samples and what `more` left unfinished for `rows`.

    >>> cut = RolloutOutput(torch.tensor([[5, 2], [7, 8], [4, 0]]), torch.tensor([[1, 1], [1, 1], [1, 0]]),
    ...                     torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-3.0, 0.0]]), 3,
    ...                     torch.tensor([False, True, True]))
    >>> more = RolloutOutput(torch.tensor([[9, 2]]), torch.tensor([[1, 1]]), torch.tensor([[-0.5, -0.5]]), 4)
    >>> c = continue_samples(cut, torch.tensor([1]), more, pad_id=0)
    >>> c.responses.tolist(), c.response_mask.tolist()
    ([[5, 2, 0, 0], [7, 8, 9, 2], [4, 0, 0, 0]], [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    >>> c.weights_version, c.unfinished.tolist()
    (3, [False, False, True])
    >>> c = continue_samples(cut, torch.tensor([2]), more, pad_id=0)  # after its one token
    >>> c.responses[2].tolist(), c.logprobs[2].tolist(), c.unfinished.tolist()
    ([4, 9, 2], [-3.0, -0.5, -0.5], [False, True, False])
    """
    lengths = out.response_mask.sum(-1)
    width = max(out.responses.shape[1], int((lengths[rows] + more.responses.shape[1]).max()))

    def widen(x: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([x, torch.full((len(x), width - x.shape[1]), fill, dtype=x.dtype)], dim=1)

    responses, mask, logprobs = (
        widen(out.responses, pad_id),
        widen(out.response_mask, 0),
        widen(out.logprobs, 0.0),
    )
    extra = more.responses.shape[1]
    for k, r in enumerate(rows.tolist()):
        at = int(lengths[r])
        responses[r, at : at + extra] = more.responses[k]
        mask[r, at : at + extra] = more.response_mask[k]
        logprobs[r, at : at + extra] = more.logprobs[k]
    unfinished = (
        out.unfinished.clone()
        if out.unfinished is not None
        else torch.zeros(len(responses), dtype=torch.bool)
    )
    unfinished[rows] = more.unfinished if more.unfinished is not None else False
    return RolloutOutput(
        responses, mask, logprobs, out.weights_version, unfinished if unfinished.any() else None
    )
