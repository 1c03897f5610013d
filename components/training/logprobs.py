"""Per-token log-probs and entropy of responses under a causal LM."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from components.models.loading import image_token_id
from components.models.moe import Routing, replay_routes

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def sequence_inputs(
    prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate left-padded prompts (N, P) and right-padded responses (N, R) -> ids, mask, positions (N, P+R)."""
    ids = torch.cat([prompts, responses], dim=1)
    mask = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def response_attention(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The response tokens a forward pass sees (N, R): all of them, tool turns included, when the batch has
    `response_attention_mask` (multi-turn); else response_mask. Losses use response_mask (model tokens only)."""
    return t.get("response_attention_mask", t["response_mask"])


def vision_inputs(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The image inputs of a batch's rows for a VLM's forward ({} for text): `pixel_values` (N, C, H, W)."""
    return {"pixel_values": t["pixel_values"]} if "pixel_values" in t else {}


def moe_routes(t: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """An MoE rollout's routes over a forward's positions, prompt then response (N, P+R, L, k); None when
    the batch has none (a dense policy, or an engine that does not record them)."""
    if "prompt_routes" not in t:
        return None
    return torch.cat([t["prompt_routes"], t["response_routes"]], dim=1)


def response_logprobs(
    model: PreTrainedModel,
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    pixel_values: torch.Tensor | None = None,
    routing: Routing | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(response_t | prefix) (N, R) and, if asked, the entropy of each step's distribution (N, R).

    Logits are divided by the sampling temperature, as the rollout engine did when it sampled. A VLM gets each
    row's image as `pixel_values` (N, C, H, W); its image tokens are part of the prompt. An MoE policy's
    forward replays (or compares with) the rollout's routes when `routing` is given (components/models/moe.py).
    """
    logits = sequence_logits(model, prompts, prompt_mask, responses, response_mask, pixel_values, routing)
    return logits_logprobs(logits, responses, temperature, with_entropy, image_token_id(model))


def sequence_logits(
    model: PreTrainedModel,
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    pixel_values: torch.Tensor | None = None,
    routing: Routing | None = None,
) -> torch.Tensor:
    """The logits (N, P+R, V) of the model's forward over prompt + response (see response_logprobs)."""
    ids, mask, positions = sequence_inputs(prompts, prompt_mask, responses, response_mask)
    images = {"pixel_values": pixel_values} if pixel_values is not None else {}
    routed = (
        replay_routes(model, routing.routes, mask, routing.replay, routing.stats)
        if routing is not None
        else nullcontext()
    )
    with routed:
        return model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **images
        ).logits


def response_distributions(logits: torch.Tensor, responses: torch.Tensor, temperature: float) -> torch.Tensor:
    """The log-softmax (N, R, V) over the vocabulary at each response position, from the logits (N, P+R, V)
    of prompt + response: the distributions the response tokens were drawn from (temperature-scaled)."""
    P, R = logits.shape[1] - responses.shape[1], responses.shape[1]
    scaled = logits[:, P - 1 : P + R - 1, :].float()
    if temperature not in (0, 1):
        scaled = scaled / temperature
    return torch.log_softmax(scaled, dim=-1)


def logits_logprobs(
    logits: torch.Tensor,
    responses: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    banned: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The responses' log-probs (N, R) (and entropies) from the logits (N, P+R, V) of prompt + response: the
    last R positions' predecessors predict them; `banned`, a VLM's image token, is never a choice."""
    P = logits.shape[1] - responses.shape[1]
    R = responses.shape[1]
    logits = logits[:, P - 1 : P + R - 1, :].float()  # (N, R, V): position t predicts response token t
    if banned is not None:  # a VLM never writes its image token (the engine samples without it too)
        logits[..., banned] = float("-inf")
    if temperature not in (0, 1):
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, responses[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@torch.no_grad()
def batch_logprobs(
    model: PreTrainedModel,
    batch,
    temperature: float,
    micro_batch_size: int | None,
    routing: Callable[[dict[str, torch.Tensor]], Routing | None] = lambda t: None,
) -> torch.Tensor:
    """Log-probs (N, R) of a Batch's responses, micro_batch_size rows per forward pass (None = all at once);
    `routing` gives each part's MoE routing (none by default)."""
    from components.training.loop import row_chunks

    model.eval()
    parts = []
    for p in row_chunks(batch, micro_batch_size):
        t = p.tensors
        parts.append(
            response_logprobs(
                model,
                t["prompts"],
                t["prompt_mask"],
                t["responses"],
                response_attention(t),
                temperature,
                **vision_inputs(t),
                routing=routing(t),
            )[0]
        )
    return torch.cat(parts)


@torch.no_grad()
def engine_logprob_gaps(model: PreTrainedModel, prompts: list[list[int]], out, pad_id: int) -> torch.Tensor:
    """|engine log-prob - the model's forward log-prob| of every sampled token (1-D, masked tokens only): how
    closely a rollout engine's `out` (RolloutOutput, rows i*n + j = sample j of prompt i) follows `model`."""
    from components.rollout.base import left_pad

    n = len(out.responses) // len(prompts)
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], pad_id)
    device = next(model.parameters()).device
    ours, _ = response_logprobs(
        model,
        prompt_ids.to(device),
        prompt_mask.to(device),
        out.responses.to(device),
        out.response_mask.to(device),
    )
    mask = out.response_mask.bool()
    return (ours.cpu()[mask] - out.logprobs[mask]).abs()
