"""The `hf` engine: batched sampling with a transformers model and its KV cache, on token ids."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from components.rollout.base import RolloutOutput, SamplingParams
from components.rollout.fast_decode import LeanDecoder, prefill_mask, unsupported_reason
from components.rollout.sampling import sample_tokens

COMPACT_FRACTION = 0.25  # the lean loop drops finished rows once this fraction of the active ones has finished


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) ids and attention mask, left-padded so every prompt ends at the last column."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


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

    def _check_newer(self, version: int) -> None:
        if version < self.weights_version:
            raise ValueError(f"weights version {version} is older than the engine's {self.weights_version}")

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._check_newer(version)
        self.model.load_state_dict(state_dict, strict=True)
        self.weights_version = version

    def mark_current(self, version: int) -> None:
        """The engine samples with the policy's own module (colocated): its weights are already the policy's,
        only the version moves."""
        self._check_newer(version)
        self.weights_version = version

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> RolloutOutput:
        gen = torch.Generator().manual_seed(seed)
        ids, mask = left_pad(prompts, self.pad_id)
        ids, mask = ids.repeat_interleave(params.n, 0), mask.repeat_interleave(params.n, 0)  # (N, P)
        if self.lean is not None:
            tokens_out, logp_out = self._generate_lean(ids, mask, params, gen)
        else:
            tokens_out, logp_out = self._generate_hf(ids, mask, params, gen)
        response_mask = response_mask_from(tokens_out, self.eos_id, self.pad_id)
        return RolloutOutput(tokens_out, response_mask, logp_out * response_mask, self.weights_version)

    def _generate_lean(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                       gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled tokens and log-probs (N, R), R = the steps taken (all rows done or max_new_tokens)."""
        lean, dtype = self.lean, next(self.model.parameters()).dtype
        lean.pack()  # every call: the weights may have moved in place (a colocated policy)
        n_rows, p = ids.shape
        total = p + params.max_new_tokens
        cache = lean.new_cache(n_rows, total, dtype)
        rope = lean.rotary_table(total, dtype)
        keys = torch.zeros((n_rows, total), dtype=torch.bool)
        keys[:, :p] = mask.bool()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = lean.forward(ids, positions, cache, 0, prefill_mask(mask), rope)
        next_pos = positions[:, -1:] + 1
        tokens_out = torch.full((n_rows, params.max_new_tokens), self.pad_id, dtype=torch.long)
        logp_out = torch.zeros((n_rows, params.max_new_tokens))
        active = torch.arange(n_rows)  # original row of each row still in the batch
        done = torch.zeros(n_rows, dtype=torch.bool)
        steps = 0
        for t in range(params.max_new_tokens):
            tok, logp = sample_tokens(logits, params.temperature, params.top_k, params.top_p, gen)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            tokens_out[active, t] = tok
            logp_out[active, t] = torch.where(done, torch.zeros_like(logp), logp)
            steps = t + 1
            done = done | (tok == self.eos_id)
            n_done = int(done.sum())
            if n_done == len(active) or t == params.max_new_tokens - 1:
                break
            if n_done >= max(1, COMPACT_FRACTION * len(active)):  # drop the finished rows
                keep = (~done).nonzero().squeeze(-1)
                active, tok, next_pos, keys = active[keep], tok[keep], next_pos[keep], keys[keep]
                cache = [(k[keep], v[keep]) for k, v in cache]
                done = done[keep]
            col = p + t
            keys[:, col] = True
            logits = lean.forward(tok[:, None], next_pos, cache, col, keys[:, None, None, :col + 1], rope)
            next_pos = next_pos + 1
        return tokens_out[:, :steps], logp_out[:, :steps]

    def _generate_hf(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The same loop on transformers' forward and DynamicCache (any causal LM)."""
        n_rows = ids.shape[0]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                         logits_to_keep=1)
        tokens_out = torch.full((n_rows, params.max_new_tokens), self.pad_id, dtype=torch.long)
        logp_out = torch.zeros((n_rows, params.max_new_tokens))
        done = torch.zeros(n_rows, dtype=torch.bool)
        next_pos = positions[:, -1:] + 1
        steps = 0
        for t in range(params.max_new_tokens):
            tok, logp = sample_tokens(out.logits[:, -1, :], params.temperature, params.top_k, params.top_p, gen)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            tokens_out[:, t] = tok
            logp_out[:, t] = torch.where(done, torch.zeros_like(logp), logp)
            steps = t + 1
            done = done | (tok == self.eos_id)
            if bool(done.all()) or t == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((n_rows, 1), dtype=mask.dtype)], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                             cache=cache, use_cache=True)
            next_pos = next_pos + 1
        return tokens_out[:, :steps], logp_out[:, :steps]


def response_mask_from(tokens: torch.Tensor, eos_id: int, pad_id: int) -> torch.Tensor:
    """1 up to and including the first EOS, 0 after it. (N, R) -> (N, R) long."""
    is_eos = tokens == eos_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).long()
