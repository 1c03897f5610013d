"""Token sampling from logits: temperature, top-k, top-p, seeded. Pure tensor functions."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits (N, V) outside the top-k and the top-p nucleus to -inf. Keeps at least one token."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = (
            cum - torch.softmax(sorted_logits, dim=-1)
        ) >= top_p  # mass before this token already >= p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens (N,) and their log-probs (N,) under softmax(logits / temperature); greedy when 0."""
    if temperature == 0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = logp.argmax(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(filter_logits(scaled, top_k, top_p), dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
