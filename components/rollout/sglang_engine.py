"""The `sglang` engine: SGLang's offline `Engine` on token ids. Its radix cache shares the KV of common
prefixes (a prompt's n samples, and each multi-turn sample's earlier turns) across requests.

With LoRA (actor.lora.rank > 0, engine.lora_merge_on_sync false) it holds the base model with slots for the
policy's adapters and receives the adapters alone: each update is written as a peft adapter directory, loaded
under a new name per weights version (`load_lora_adapter`), and every request names it (`lora_path`); the
version before is unloaded. Written against SGLang 0.5.23's Engine API.

Imported only when engine.type=sglang; `pip install 'reinforge[gpu]'` installs SGLang.
"""

from __future__ import annotations

import torch

from components.models.loading import is_vlm_dir
from components.rollout.base import PromptImages, RolloutOutput, check_newer
from components.rollout.completions import AdapterDirs, context_length, logprob_of, require, to_rollout_output
from components.settings import EngineOptions, SamplingParams


def sampling_params(params: SamplingParams, seed: int | None = None) -> dict:
    """Our SamplingParams as SGLang's dict (top_k -1 = off), for one request seeded with `seed`.

    >>> sampling_params(SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(7,)))["stop_token_ids"]
    [7]
    """
    out = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,
    }
    return out if seed is None else {**out, "sampling_seed": seed}


def request_params(params: SamplingParams, seed: int, prompts: int) -> list[dict]:
    """One dict per request: samples are separate requests (each prompt repeated n times, so the radix cache
    serves the shared prompt once), each with its own seed derived from `seed`.

    >>> [p["sampling_seed"] for p in request_params(SamplingParams(n=2), 10, 2)]
    [10, 11, 12, 13]
    """
    return [sampling_params(params, (seed + i) % 2**31) for i in range(prompts * params.n)]


def request_inputs(prompts: list[list[int]], n: int, images: PromptImages | None) -> dict:
    """SGLang's generate inputs for each prompt repeated n times: `input_ids`, and for a VLM `image_data` (one
    image or None per request) with each prompt collapsed to one image placeholder, which SGLang's processor
    for the model expands.

    >>> request_inputs([[1, 2]], 2, None)
    {'input_ids': [[1, 2], [1, 2]]}
    >>> request_inputs([[5, 9, 9, 2]], 1, PromptImages(torch.zeros(1), ["png"], 9))
    {'input_ids': [[5, 9, 2]], 'image_data': ['png']}
    """
    if images is None:
        return {"input_ids": [p for p in prompts for _ in range(n)]}
    ids = [images.collapsed(p) if img is not None else p for p, img in zip(prompts, images.raw, strict=True)]
    return {
        "input_ids": [p for p in ids for _ in range(n)],
        "image_data": [img for img in images.raw for _ in range(n)],
    }


def completions(outputs: list[dict]) -> list[tuple[list[int], list[float]]]:
    """SGLang results (`output_ids`, `meta_info.output_token_logprobs` = [(logprob, token_id, text)]) -> per-sample
    (ids, log-probs)."""
    samples = []
    for out in outputs:
        ids = list(out["output_ids"])
        entries = out["meta_info"].get("output_token_logprobs") or []
        samples.append((ids, [logprob_of(e[0], t) for e, t in zip(entries, ids)]))
    return samples


def lora_server_args(options: EngineOptions) -> dict:
    """SGLang's server args that reserve slots for the policy's adapters before any is loaded: their rank and
    target modules ("all" for our all-linear), one adapter per batch and two held (the one in use, the one
    before it while its requests finish); {} without adapters.

    >>> lora_server_args(EngineOptions(lora_rank=16))["lora_target_modules"]
    ['all']
    >>> lora_server_args(EngineOptions(lora_rank=8, lora_targets=("q_proj", "v_proj")))["max_lora_rank"]
    8
    >>> lora_server_args(EngineOptions())
    {}
    """
    if not options.lora_rank:
        return {}
    targets = options.lora_targets
    return {
        "enable_lora": True,
        "max_lora_rank": options.lora_rank,
        "lora_target_modules": ["all"] if targets == "all-linear" else list(targets),
        "max_loras_per_batch": 1,
        "max_loaded_loras": 2,
    }


class SGLangEngine:
    def __init__(self, path: str, eos_id: int, pad_id: int, options: EngineOptions = EngineOptions()):
        sglang = require("sglang")
        self.eos_id, self.pad_id, self.options = eos_id, pad_id, options
        self.weights_version = 0
        self.path, self.adapter_dirs, self.lora_name = path, None, None
        self.engine = sglang.Engine(
            model_path=path,
            trust_remote_code=self.options.trust_remote_code,
            dtype=options.dtype,
            tp_size=options.tensor_parallel_size,
            mem_fraction_static=options.gpu_memory_utilization,
            random_seed=options.seed,
            context_length=context_length(path, options.max_model_len),
            enable_memory_saver=options.sleep_during_update,
            # a VLM's images go through SGLang's processor for the model, which needs its tokenizer
            skip_tokenizer_init=not is_vlm_dir(path),
            **lora_server_args(options),
        )

    def use_adapters(self, s) -> None:
        """Hold the policy's LoRA adapters (components/models/lora.LoraSettings) over the base model: each
        update_weights then carries the adapters alone. The engine must have been built with slots for them
        (EngineOptions.lora_rank, from actor.lora.rank)."""
        if not hasattr(self.engine, "load_lora_adapter"):
            raise RuntimeError(
                "this sglang has no Engine.load_lora_adapter, which adapter-only sync needs: upgrade it "
                "(pip install -U sglang), or set engine.lora_merge_on_sync=true"
            )
        if not self.options.lora_rank or s.rank > self.options.lora_rank:
            raise ValueError(
                f"the sglang engine was built for adapters of rank {self.options.lora_rank}, not {s.rank}: "
                "build it with EngineOptions(lora_rank=actor.lora.rank)"
            )
        self.adapter_dirs = AdapterDirs(s, self.path)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int, images: PromptImages | None = None
    ) -> RolloutOutput:
        requests = len(prompts) * params.n
        outs = self.engine.generate(
            **request_inputs(prompts, params.n, images),
            sampling_params=request_params(params, seed, len(prompts)),
            return_logprob=True,
            lora_path=[self.lora_name] * requests if self.lora_name else None,
        )
        return to_rollout_output(
            completions(outs),
            {self.eos_id, *params.stop_token_ids},
            self.pad_id,
            params.max_new_tokens,
            self.weights_version,
        )

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        check_newer(self.weights_version, version)
        if self.adapter_dirs is not None:
            self._load_adapters(state_dict, version)
            return
        self.engine.update_weights_from_tensor(named_tensors=list(state_dict.items()), flush_cache=True)
        self.weights_version = version

    def _load_adapters(self, state: dict[str, torch.Tensor], version: int) -> None:
        """The adapters of weights `version`, loaded under a name of their own (so no cached prefix of an older
        version's adapters is reused) and named by every request from now on; the version before unloaded."""
        name, before = f"policy-v{version}", self.lora_name
        result = self.engine.load_lora_adapter(name, str(self.adapter_dirs.write(state, version)))
        if getattr(result, "success", True) is False:
            why = getattr(result, "error_message", None) or result
            raise RuntimeError(f"sglang did not load the adapters of weights version {version}: {why}")
        self.lora_name = name
        if before is not None:
            self.engine.unload_lora_adapter(before)
        self.weights_version = version

    def sleep(self) -> None:
        if self.options.sleep_during_update:
            self.engine.release_memory_occupation()

    def wake(self) -> None:
        if self.options.sleep_during_update:
            self.engine.resume_memory_occupation()
