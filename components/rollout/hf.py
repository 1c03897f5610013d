"""The `hf` engine: batched sampling with a transformers model and its KV cache, on token ids."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from components.rollout.base import RolloutOutput, SamplingParams
from components.rollout.sampling import sample_tokens


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
    """Holds its own copy of the policy; `update_weights` loads each new version in place."""

    def __init__(self, model: PreTrainedModel, eos_id: int, pad_id: int):
        self.model = model.eval()
        self.eos_id, self.pad_id = eos_id, pad_id
        self.weights_version = 0

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
        tokens_out, logp_out = tokens_out[:, :steps], logp_out[:, :steps]
        response_mask = response_mask_from(tokens_out, self.eos_id, self.pad_id)
        return RolloutOutput(tokens_out, response_mask, logp_out * response_mask, self.weights_version)


def response_mask_from(tokens: torch.Tensor, eos_id: int, pad_id: int) -> torch.Tensor:
    """1 up to and including the first EOS, 0 after it. (N, R) -> (N, R) long."""
    is_eos = tokens == eos_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).long()
