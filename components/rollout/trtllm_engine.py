"""The `trtllm` engine: TensorRT-LLM's `LLM` API (PyTorch backend) on token ids, for low-latency rollout.

Imported only when engine.type=trtllm (`pip install tensorrt-llm`). Weight updates: TensorRT-LLM's LLM API has
no public in-place update, so the new weights are written (safetensors) next to the model's config and the LLM
is rebuilt from them; a release whose LLM has `update_weights` is updated in place instead.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from components.rollout.base import PromptImages, RolloutOutput, check_newer
from components.rollout.completions import context_length, request_completions, require, to_rollout_output
from components.settings import EngineOptions, SamplingParams


def sampling_kwargs(params: SamplingParams, seed: int) -> dict:
    """Our SamplingParams as TensorRT-LLM's (top_k None = off; logprobs=0 returns the sampled token's).

    >>> sampling_kwargs(SamplingParams(n=2, top_k=0), 3)["top_k"] is None
    True
    """
    return {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else None,
        "max_tokens": params.max_new_tokens,
        "seed": seed,
        "logprobs": 0,
        "stop_token_ids": list(params.stop_token_ids) or None,
    }


completions = (
    request_completions  # TensorRT-LLM's RequestOutput: `.outputs[j].token_ids`, `.logprobs` (floats)
)


class TRTLLMEngine:
    def __init__(self, path: str, eos_id: int, pad_id: int, options: EngineOptions = EngineOptions()):
        self.trt = require("trtllm")
        self.path, self.eos_id, self.pad_id, self.options = path, eos_id, pad_id, options
        self.weights_version = 0
        self._dir: str | None = None
        self.llm = self._build(path)

    def _build(self, path: str):
        kv = self.trt.llmapi.KvCacheConfig(free_gpu_memory_fraction=self.options.gpu_memory_utilization)
        return self.trt.LLM(
            model=path,
            trust_remote_code=self.options.trust_remote_code,
            tensor_parallel_size=self.options.tensor_parallel_size,
            dtype=self.options.dtype,
            kv_cache_config=kv,
            max_seq_len=context_length(path, self.options.max_model_len),
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int, images: PromptImages | None = None
    ) -> RolloutOutput:
        if images is not None:  # the config check refuses this pairing first; this guards direct use
            raise ValueError(
                "the trtllm engine takes no images: use engine.type=hf, vllm or sglang for a VLM"
            )
        sp = self.trt.SamplingParams(**sampling_kwargs(params, seed))
        outs = self.llm.generate(prompts, sampling_params=sp, use_tqdm=False)
        return to_rollout_output(
            completions(outs),
            {self.eos_id, *params.stop_token_ids},
            self.pad_id,
            params.max_new_tokens,
            self.weights_version,
        )

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        check_newer(self.weights_version, version)
        if hasattr(self.llm, "update_weights"):
            self.llm.update_weights(list(state_dict.items()))
        else:
            from safetensors.torch import save_file

            new_dir = tempfile.mkdtemp(prefix="reinforge-trtllm-")
            for f in Path(self.path).iterdir():  # config and tokenizer files; the weights are ours
                if (
                    f.is_file()
                    and f.suffix not in (".safetensors", ".bin")
                    and not f.name.endswith(".index.json")
                ):
                    shutil.copy(f, new_dir)
            save_file({k: v.contiguous() for k, v in state_dict.items()}, f"{new_dir}/model.safetensors")
            self.llm.shutdown()
            self.llm = self._build(new_dir)
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = new_dir
        self.weights_version = version
