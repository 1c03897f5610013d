"""The `vllm` engine: vLLM's offline `LLM` on token ids, with in-place weight updates and sleep/wake.

With LoRA (actor.lora.rank > 0, engine.lora_merge_on_sync false) it holds the base model and receives the
adapters alone: each update is written as a peft adapter directory and sampled through vLLM's LoRA request
path under a new adapter id (the weights version), so no request ever mixes two versions' adapters.

Imported only when engine.type=vllm; `pip install 'reinforge[gpu]'` installs vLLM. The engine runs inside the
rollout worker's Ray actor (one per `engine.num_engines`), with `engine.tensor_parallel_size` GPUs each.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import torch

from components.rollout.base import PromptImages, RolloutOutput, check_newer
from components.rollout.completions import (
    AdapterDirs,
    completion_sample,
    context_length,
    lora_slots,
    request_completions,
    require,
    to_rollout_output,
)
from components.settings import EngineOptions, SamplingParams


def sampling_kwargs(params: SamplingParams, seed: int) -> dict:
    """Our SamplingParams as vLLM's (top_k -1 = off; logprobs=0 returns the sampled token's log-prob).

    >>> sampling_kwargs(SamplingParams(n=4, temperature=0.7, top_k=0, max_new_tokens=32), 9)["top_k"]
    -1
    """
    return {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_tokens": params.max_new_tokens,
        "seed": seed,
        "logprobs": 0,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,
        "detokenize": False,
    }


def token_prompts(prompts: list[list[int]], images: PromptImages | None) -> list[dict]:
    """vLLM's TokensPrompt fields per prompt: a VLM prompt carries its image as `multi_modal_data` and one
    image placeholder, which vLLM's own processor for the model expands (as our processor did for the trainer).

    >>> token_prompts([[1, 2]], None)
    [{'prompt_token_ids': [1, 2]}]
    >>> token_prompts([[5, 9, 9, 2], [5, 2]], PromptImages(torch.zeros(2), ["png", None], 9))
    [{'prompt_token_ids': [5, 9, 2], 'multi_modal_data': {'image': 'png'}}, {'prompt_token_ids': [5, 2]}]
    """
    if images is None:
        return [{"prompt_token_ids": p} for p in prompts]
    return [
        {"prompt_token_ids": images.collapsed(p), "multi_modal_data": {"image": img}}
        if img is not None
        else {"prompt_token_ids": p}
        for p, img in zip(prompts, images.raw, strict=True)
    ]


completions = request_completions  # vLLM's RequestOutput: `.outputs[j].logprobs` = [{token_id: Logprob}]


class VLLMEngine:
    """vLLM's LLM over the model at `path`. update_weights reloads a new state dict into the running model
    (the workers' `reload_weights`) and clears the prefix cache, so no cached KV of old weights is reused."""

    def __init__(self, path: str, eos_id: int, pad_id: int, options: EngineOptions = EngineOptions()):
        # the engine core in this process: weight updates reach the model without pickling it across processes
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = require("vllm")
        self.eos_id, self.pad_id, self.options = eos_id, pad_id, options
        self.weights_version = 0
        from vllm.platforms import current_platform

        # vLLM's CPU build cannot rewind a seeded request's generator when its prefill is split across steps
        cpu = {"enable_chunked_prefill": False} if current_platform.is_cpu() else {}
        self.path, self.lora_request, self.adapter_dirs = path, None, None
        self._requests = 0  # interruptible generations so far: their request ids are unique
        if options.lora_rank:  # one adapter at a time: the policy's current version
            cpu |= {"enable_lora": True, "max_lora_rank": lora_slots(options.lora_rank), "max_loras": 1}
        self.llm = vllm.LLM(
            model=path,
            tokenizer=path,
            trust_remote_code=options.trust_remote_code,
            dtype=options.dtype,
            seed=options.seed,
            tensor_parallel_size=options.tensor_parallel_size,
            gpu_memory_utilization=options.gpu_memory_utilization,
            max_model_len=context_length(path, options.max_model_len),
            enable_sleep_mode=options.sleep_during_update,
            enforce_eager=options.enforce_eager,
            enable_prefix_caching=True,
            # log-probs after temperature (and top-k / top-p), as our engines return them
            logprobs_mode="processed_logprobs",
            **cpu,
        )
        self._vllm = vllm

    def use_adapters(self, s) -> None:
        """Hold the policy's LoRA adapters (components/models/lora.LoraSettings) over the base model: each
        update_weights then carries the adapters alone. The engine must have been built with their rank
        (EngineOptions.lora_rank, from actor.lora.rank)."""
        if not self.options.lora_rank or lora_slots(s.rank) > lora_slots(self.options.lora_rank):
            raise ValueError(
                f"the vllm engine was built for adapters of rank {self.options.lora_rank}, not {s.rank}: "
                "build it with EngineOptions(lora_rank=actor.lora.rank)"
            )
        self.adapter_dirs = AdapterDirs(s, self.path)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: int,
        images: PromptImages | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> RolloutOutput:
        """`interrupt`: asked after each of the engine's scheduler steps; when it answers true, the samples
        still running are aborted and returned cut short, marked `unfinished` (partial rollouts)."""
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(**r) for r in token_prompts(prompts, images)]
        stops = {self.eos_id, *params.stop_token_ids}
        if interrupt is not None:
            return self._generate_until(requests, params, seed, stops, interrupt)
        sp = self._vllm.SamplingParams(**sampling_kwargs(params, seed))
        outs = self.llm.generate(requests, sp, use_tqdm=False, lora_request=self.lora_request)
        return to_rollout_output(
            completions(outs), stops, self.pad_id, params.max_new_tokens, self.weights_version
        )

    def _generate_until(
        self,
        requests: list,
        params: SamplingParams,
        seed: int,
        stops: set[int],
        interrupt: Callable[[], bool],
    ) -> RolloutOutput:
        """The requests stepped through vLLM's engine one scheduler step at a time, as LLM.generate does, each
        step's outputs kept whole (cumulative: every running sample's tokens and log-probs so far). Sampling
        is the same as generate's: the same requests, seeds and schedule."""
        from vllm.sampling_params import RequestOutputKind

        sp = self._vllm.SamplingParams(
            **sampling_kwargs(params, seed), output_kind=RequestOutputKind.CUMULATIVE
        )
        # the engine's own add_request: LLM.generate and LLM.enqueue make every request report only its end
        engine, latest = self.llm.llm_engine, {}  # (request id, sample index) -> its completion so far
        self._requests += 1
        request_ids = [f"partial-{self._requests}-{i}" for i in range(len(requests))]
        try:
            for rid, request in zip(request_ids, requests, strict=True):
                engine.add_request(rid, request, sp, lora_request=self.lora_request)
            while engine.has_unfinished_requests():
                for request in engine.step():
                    for c in request.outputs:
                        latest[(request.request_id, c.index)] = c
                if engine.has_unfinished_requests() and interrupt():
                    break
        finally:  # interrupted, or failed: nothing of this call is left running (finished ones are untracked)
            engine.abort_request(request_ids)
        samples, cut = [], []
        for rid in request_ids:
            for j in range(params.n):
                c = latest.get((rid, j))  # None: never scheduled before the interrupt
                samples.append(completion_sample(c) if c is not None else ([], []))
                cut.append(c is None or c.finish_reason in (None, "abort"))
        out = to_rollout_output(samples, stops, self.pad_id, params.max_new_tokens, self.weights_version)
        return replace(out, unfinished=torch.tensor(cut)) if any(cut) else out

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        check_newer(self.weights_version, version)
        if self.adapter_dirs is not None:
            self._load_adapters(state_dict, version)
            return
        # vLLM's in-place reload takes checkpoint-format names and tensors and redoes whatever its kernels did to
        # them after loading (repacking, fusing); the engine core runs in this process, so nothing is pickled
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": list(state_dict.items()), "is_checkpoint_format": True},
        )
        self.llm.reset_prefix_cache()
        self.weights_version = version

    def _load_adapters(self, state: dict[str, torch.Tensor], version: int) -> None:
        """The adapters of weights `version` as a peft adapter directory, sampled from the next request on under
        adapter id `version` (vLLM loads it then; a new id, so no cached adapter or prefix of an older version
        is reused)."""
        from vllm.lora.request import LoRARequest

        out = self.adapter_dirs.write(state, version)
        self.lora_request = LoRARequest(f"policy-v{version}", version, str(out))
        self.llm.reset_prefix_cache()
        self.weights_version = version

    def close(self) -> None:
        """Stop the engine core and free its KV cache (host memory on vLLM's CPU build) and adapter files."""
        import gc

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if self.adapter_dirs is not None:
            self.adapter_dirs.remove()

    def sleep(self) -> None:
        """Free the KV cache (and offload the weights) while the policy trains on the same GPU."""
        if self.options.sleep_during_update:
            self.llm.sleep(level=1)

    def wake(self) -> None:
        if self.options.sleep_during_update:
            self.llm.wake_up()
