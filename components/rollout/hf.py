"""The `hf` engine: batched sampling with a transformers model and its KV cache, on token ids."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from components.models.loading import image_token_id
from components.models.lora import is_lora
from components.models.moe import NOT_RECORDED, RouteRecorder, is_moe
from components.rollout.base import PromptImages, RolloutOutput, check_newer, left_pad
from components.rollout.fast_decode import LeanDecoder, prefill_mask, unsupported_reason
from components.rollout.sampling import sample_tokens
from components.settings import SamplingParams

if TYPE_CHECKING:  # transformers' modeling code: imported where a model is built, not here
    from transformers import PreTrainedModel

COMPACT_FRACTION = (
    0.25  # the lean loop drops finished rows once this fraction of the active ones has finished
)


class HFEngine:
    """Holds its own copy of the policy (or, colocated, the policy's own module); `update_weights` loads each
    new version in place. Llama-family models sample with the lean loop (components/rollout/fast_decode.py),
    others with transformers' forward; `fast_decode=False` forces the latter."""

    def __init__(self, model: PreTrainedModel, eos_id: int, pad_id: int, fast_decode: bool = True):
        self.model = model.eval()
        self.eos_id, self.pad_id = eos_id, pad_id
        self.weights_version = 0
        self.slow_reason = unsupported_reason(model) if fast_decode else "fast_decode=False"
        self.lean = LeanDecoder(model) if self.slow_reason is None else None
        self.banned = image_token_id(model)  # a VLM's image token is never sampled
        self.moe = is_moe(model)  # record each token's experts, for the trainer to replay
        self.adapters = False  # updates carry LoRA adapters alone (use_adapters)
        if is_lora(model):  # a colocated LoRA policy: its adapters sit in transformers' forward
            self.slow_reason, self.lean = "LoRA adapters", None

    def use_adapters(self, s) -> None:
        """Hold LoRA adapters (components/models/lora.LoraSettings) over this engine's base model: each update
        then carries the adapters alone, and sampling goes through transformers' forward, where they sit."""
        from components.models.lora import apply_lora

        self.model = apply_lora(self.model, s).eval()
        self.slow_reason, self.lean, self.adapters = "LoRA adapters", None, True

    @classmethod
    def from_path(
        cls, path: str, eos_id: int, pad_id: int, options, model=None, key: str = "actor.model.path"
    ) -> HFEngine:
        """Load the model at `path` (or sample with `model`, a colocated policy's own module)."""
        from components.models.loading import load_model

        if model is None:
            model = load_model(
                path,
                options.dtype,
                options.attention_implementation,
                key,
                trust_remote_code=options.trust_remote_code,
            )
            if torch.cuda.is_available():  # a Ray actor sees only the GPUs it reserved (engine.num_gpus)
                model = model.to("cuda")
        return cls(model, eos_id, pad_id)

    def sleep(self) -> None:
        """Nothing to free: the hf engine keeps no KV cache between rollouts."""

    def wake(self) -> None:
        """Nothing to restore."""

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        check_newer(self.weights_version, version)
        if self.adapters:
            from components.models.lora import load_adapter_state

            load_adapter_state(self.model, state_dict, f"rollout engine, weights version {version}")
        else:
            self.model.load_state_dict(state_dict, strict=True)
        self.weights_version = version

    def mark_current(self, version: int) -> None:
        """The engine samples with the policy's own module (colocated): its weights are already the policy's,
        only the version moves."""
        check_newer(self.weights_version, version)
        self.weights_version = version

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: int,
        images: PromptImages | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> RolloutOutput:
        """`images`: each prompt's image, for a VLM, as pixels (its prefill sees them; the KV cache then holds
        the image tokens, or, for cross-attention, the image states). `interrupt`: asked after each decode
        step; when it answers true, sampling stops there and `unfinished` marks the samples cut short (their
        tokens so far are kept, to be continued: partial rollouts)."""
        device = next(self.model.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        ids, mask = left_pad(prompts, self.pad_id)
        ids = ids.repeat_interleave(params.n, 0).to(device)  # (N, P)
        mask = mask.repeat_interleave(params.n, 0).to(device)
        pixels = None if images is None else images.pixels.repeat_interleave(params.n, 0).to(device)
        recorder = RouteRecorder(self.model, ids.shape[0]) if self.moe else nullcontext()
        with recorder:
            out = self._sample(ids, mask, pixels, params, gen, interrupt)
        if self.moe:  # the last sampled token was never fed: nothing recorded there
            routes = recorder.routes()
            missing = ids.shape[1] + out.responses.shape[1] - routes.shape[1]
            out.routes = torch.cat([routes, torch.full_like(routes[:, :missing], NOT_RECORDED)], dim=1)
        return out

    def _sample(self, ids, mask, pixels, params: SamplingParams, gen, interrupt) -> RolloutOutput:
        device = ids.device
        decoder = (
            _LeanSteps(self.lean, self.model, ids, mask, params.max_new_tokens)
            if self.lean is not None
            else _HFSteps(self.model, ids, mask, pixels)
        )
        n_rows = ids.shape[0]
        tokens_out = torch.full((n_rows, params.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logp_out = torch.zeros((n_rows, params.max_new_tokens), device=device)
        active = torch.arange(n_rows, device=device)  # original row of each row still in the batch
        done = torch.zeros(n_rows, dtype=torch.bool, device=device)
        stops = torch.tensor([self.eos_id, *params.stop_token_ids], device=device)
        logits, steps, cut = decoder.logits, 0, None
        for t in range(params.max_new_tokens):
            if self.banned is not None:
                logits[:, self.banned] = float("-inf")
            tok, logp = sample_tokens(logits, params.temperature, params.top_k, params.top_p, gen)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            tokens_out[active, t] = tok
            logp_out[active, t] = torch.where(done, torch.zeros_like(logp), logp)
            steps = t + 1
            done = done | torch.isin(tok, stops)
            n_done = int(done.sum())
            if n_done == len(active) or t == params.max_new_tokens - 1:
                break
            if interrupt is not None and interrupt():
                cut = torch.zeros(n_rows, dtype=torch.bool)
                cut[active[~done].cpu()] = True
                break
            if decoder.can_drop and n_done >= max(
                1, COMPACT_FRACTION * len(active)
            ):  # drop the finished rows
                keep = (~done).nonzero().squeeze(-1)
                decoder.keep(keep)
                active, tok, done = active[keep], tok[keep], done[keep]
            logits = decoder.advance(tok)
        tokens_out, logp_out = tokens_out[:, :steps].cpu(), logp_out[:, :steps].cpu()
        response_mask = response_mask_from(tokens_out, stops.cpu())
        return RolloutOutput(tokens_out, response_mask, logp_out * response_mask, self.weights_version, cut)


def cache_kwarg(model: PreTrainedModel) -> str:
    """The forward's name for the KV cache: `cache` in transformers 5.24, `past_key_values` in earlier ones (the
    5.19 that vLLM's CPU build pins) and in models with their own code. A cache passed under the wrong name
    would be swallowed by **kwargs and every decode step would see only its own token."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class _HFSteps:
    """Decode steps on transformers' forward and DynamicCache (any causal LM); rows are never dropped."""

    can_drop = False

    def __init__(
        self, model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, pixel_values: torch.Tensor | None
    ):
        self.model, self.mask = model, mask
        from transformers import DynamicCache

        self.cache = {cache_kwarg(model): DynamicCache()}
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        images = {"pixel_values": pixel_values} if pixel_values is not None else {}
        self.logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **self.cache,
            use_cache=True,
            logits_to_keep=1,
            **images,
        ).logits[:, -1, :]
        self.next_pos = positions[:, -1:] + 1

    def advance(self, tok: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) after feeding one token per row."""
        self.mask = torch.cat(
            [self.mask, torch.ones((len(tok), 1), dtype=self.mask.dtype, device=tok.device)], dim=1
        )
        out = self.model(
            input_ids=tok[:, None],
            attention_mask=self.mask,
            position_ids=self.next_pos,
            **self.cache,
            use_cache=True,
        )
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1, :]


class _LeanSteps:
    """Decode steps of the lean loop (components/rollout/fast_decode.py): a cache allocated once for prompt +
    max_new_tokens columns; finished rows can be dropped (`keep`)."""

    can_drop = True

    def __init__(
        self,
        lean: LeanDecoder,
        model: PreTrainedModel,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new_tokens: int,
    ):
        dtype = next(model.parameters()).dtype
        lean.pack()  # every call: the weights may have moved in place (a colocated policy)
        n_rows, self.col = ids.shape
        total = self.col + max_new_tokens
        self.lean, self.cache = lean, lean.new_cache(n_rows, total, dtype)
        self.rope = lean.rotary_table(total, dtype)
        self.keys = torch.zeros(
            (n_rows, total), dtype=torch.bool, device=ids.device
        )  # cache columns a row sees
        self.keys[:, : self.col] = mask.bool()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.logits = lean.forward(ids, positions, self.cache, 0, prefill_mask(mask), self.rope)
        self.next_pos = positions[:, -1:] + 1

    def keep(self, rows: torch.Tensor) -> None:
        self.next_pos, self.keys = self.next_pos[rows], self.keys[rows]
        self.cache = [(k[rows], v[rows]) for k, v in self.cache]

    def advance(self, tok: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) after feeding one token per row into the next cache column."""
        col = self.col
        self.keys[:, col] = True
        logits = self.lean.forward(
            tok[:, None], self.next_pos, self.cache, col, self.keys[:, None, None, : col + 1], self.rope
        )
        self.col, self.next_pos = col + 1, self.next_pos + 1
        return logits


def response_mask_from(tokens: torch.Tensor, stops: torch.Tensor | int) -> torch.Tensor:
    """1 up to and including the first stop token (EOS, or any of `stops`), 0 after it. (N, R) -> (N, R) long."""
    is_eos = torch.isin(tokens, torch.as_tensor(stops))
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).long()
