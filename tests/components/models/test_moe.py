"""Routing replay for mixture-of-experts policies (components/models/moe.py): the hf engine records each
token's experts, and a training forward that replays them reproduces the rollout's log-probs where a
perturbation of the routing alone (near-ties decided the other way) makes its own choice differ."""

from __future__ import annotations

import copy

import pytest
import torch

from components.models.moe import Routing, RoutingStats, routers
from components.models.tiny import build_char_tokenizer, build_tiny_model
from components.rollout.batching import concat_rounds, rollout_batch
from components.rollout.hf import HFEngine
from components.settings import SamplingParams
from components.training.logprobs import moe_routes, response_logprobs
from components.training.loop import trim_padding

PROMPTS = ["12+7=", "3+4=", "100+23=", "5+5="]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def moe(tok):
    return build_tiny_model(
        tok,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=256,
        max_positions=64,
        seed=0,
        num_experts=8,
        experts_per_token=2,
    )


def _rollout(model, tok, prompts=PROMPTS, seed=0):
    ids = [tok.encode(p) for p in prompts]
    out = HFEngine(model, tok.eos_token_id, tok.pad_token_id).generate(
        ids, SamplingParams(n=4, max_new_tokens=12, temperature=1.0, top_k=0, top_p=1.0), seed=seed
    )
    rows = [{"reward_model": {"ground_truth": "1"}, "data_source": "x", "extra_info": {}} for _ in prompts]
    batch = rollout_batch(rows, ids, out, 4, tok.pad_token_id, 0)
    return out, batch.union(**{k: v.clone() for k, v in batch.tensors.items()})  # out of inference mode


def _flip_near_ties(model, scale: float):
    """Hooks that re-pick each router's top-k from its logits plus seeded noise, the gate weights left as
    they were at the experts picked: a perturbation of the routing decision alone, as another kernel or
    precision makes it on near-ties."""
    g = torch.Generator().manual_seed(1)

    def hook(module, args, out):
        logits, _, own = out
        noisy = logits.float() + scale * torch.randn(logits.shape, generator=g)
        index = noisy.topk(own.shape[-1], dim=-1).indices
        probs = torch.softmax(logits.float(), -1).gather(-1, index)
        return logits, probs / probs.sum(-1, keepdim=True), index

    return [r.register_forward_hook(hook) for r in routers(model)]


def _logprobs(model, batch, routing):
    t = batch.tensors
    with torch.no_grad():
        return response_logprobs(
            model, t["prompts"], t["prompt_mask"], t["responses"], t["response_mask"], 1.0, routing=routing
        )[0]


def test_the_engine_records_every_fed_position_of_every_moe_layer(moe, tok):
    out, batch = _rollout(moe, tok)
    n, width = out.responses.shape
    prompt_width = batch.tensors["prompts"].shape[1]
    assert out.routes.shape == (n, prompt_width + width, 2, 2)
    assert (out.routes[:, -1] == -1).all()  # the last sampled token was never fed
    assert (out.routes[:, :-1] >= 0).all() and (out.routes[:, :-1] < 8).all()
    assert batch.tensors["response_routes"].shape[:2] == (n, width)


def test_replay_gives_the_rollouts_log_probs_where_perturbed_routing_does_not(moe, tok):
    _, batch = _rollout(moe, tok)
    mask = batch.tensors["response_mask"].bool()
    rollout = batch.tensors["rollout_logprobs"]
    trainer = copy.deepcopy(moe)
    handles = _flip_near_ties(trainer, 0.05)
    try:
        own_stats, replay_stats = RoutingStats(), RoutingStats()
        own = _logprobs(trainer, batch, Routing(moe_routes(batch.tensors), False, own_stats))
        replayed = _logprobs(trainer, batch, Routing(moe_routes(batch.tensors), True, replay_stats))
    finally:
        for h in handles:
            h.remove()
    own_gap = (own - rollout)[mask].abs().max()
    replay_gap = (replayed - rollout)[mask].abs().max()
    assert own_stats.agreement() < 0.95  # the perturbation did change routes
    assert own_gap > 1e-2, own_gap  # and so the log-probs
    assert replay_gap < 1e-5, replay_gap  # replayed: the rollout's, to float tolerance
    # the agreement counts the trainer's own choice, replayed or not: replay does not hide the mismatch
    assert replay_stats.agreement() < 0.95


def test_without_a_perturbation_the_trainer_agrees_with_the_rollout(moe, tok):
    _, batch = _rollout(moe, tok)
    stats = RoutingStats()
    lp = _logprobs(moe, batch, Routing(moe_routes(batch.tensors), True, stats))
    mask = batch.tensors["response_mask"].bool()
    assert stats.agreement() == 1.0
    assert (lp - batch.tensors["rollout_logprobs"])[mask].abs().max() < 1e-5


def test_replay_keeps_the_router_trainable(moe, tok):
    _, batch = _rollout(moe, tok)
    t = batch.tensors
    model = copy.deepcopy(moe)
    lp, _ = response_logprobs(
        model,
        t["prompts"],
        t["prompt_mask"],
        t["responses"],
        t["response_mask"],
        1.0,
        routing=Routing(moe_routes(t), True),
    )
    (lp * t["response_mask"]).sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers(model))


def test_routes_follow_the_tokens_through_padding_and_joined_rounds(moe, tok):
    _, a = _rollout(moe, tok, PROMPTS[:2], seed=1)
    _, b = _rollout(moe, tok, ["1+1=", "123+456="], seed=2)
    joined = trim_padding(concat_rounds([a, b]))
    stats = RoutingStats()
    lp = _logprobs(moe, joined, Routing(moe_routes(joined.tensors), True, stats))
    mask = joined.tensors["response_mask"].bool()
    assert (lp - joined.tensors["rollout_logprobs"])[mask].abs().max() < 1e-5
    assert stats.agreement() == 1.0
