"""Mixture-of-experts policies: the routes each token took, recorded at rollout and replayed in training.

A token's log-prob under an MoE policy depends on which experts its router picks in each layer, a discrete
top-k choice. The rollout engine and the trainer compute the router's logits in different programs (a KV
cache one token at a time against one forward over the whole sequence, other kernels, other precision), so
a near-tie can go one way in one and the other way in the other, and the trainer's "old" log-prob of a
sampled token is then not the probability it was sampled with. Routing replay (R3, arXiv 2510.11370): the
engine records each token's chosen experts, and the training forward uses those experts, its gate weights
recomputed from its own router logits over them (so the router still gets a gradient).

Routers are found by shape, not by class name: a module with a `gate` and `experts` (transformers' sparse MoE
blocks: Mixtral, Qwen2-MoE, Qwen3-MoE, ...), whose gate returns (router_logits, top_k_weights,
top_k_index) over the block's flattened tokens (N * T, ...), as transformers 5 writes them.

Routes are (N, T, L, k) integer tensors: row, position, MoE layer, the k chosen experts; -1 marks a position
with nothing recorded (the forward keeps its own choice there).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

NOT_RECORDED = -1


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The gate of each sparse MoE block, in layer order ([] for a dense model)."""
    return [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


def is_moe(model: torch.nn.Module) -> bool:
    return bool(routers(model))


def _normalises(router: torch.nn.Module) -> bool:
    """Whether the router renormalises its top-k probabilities to sum to 1 (Mixtral always does; Qwen's MoE
    routers when `norm_topk_prob`)."""
    return bool(getattr(router, "norm_topk_prob", True))


class RouteRecorder:
    """Records every router call of a model's forwards, one (N, T, k) block per layer and call, while active.

    `routes()` joins the calls along the positions: (N, T_total, L, k), e.g. a prefill of P positions and
    then a decode step of one position each."""

    def __init__(self, model: torch.nn.Module, rows: int):
        self.rows, self._gates = rows, routers(model)
        self._calls: list[list[torch.Tensor]] = [[] for _ in self._gates]
        self._handles: list = []

    def __enter__(self) -> RouteRecorder:
        for layer, gate in enumerate(self._gates):
            self._handles.append(gate.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer: int):
        def record(module, args, out):
            index = out[2]  # (N * T, k)
            self._calls[layer].append(index.reshape(self.rows, -1, index.shape[-1]).to("cpu", torch.int16))

        return record

    def routes(self) -> torch.Tensor:
        """(N, T_total, L, k) int16: the experts of every position fed so far, each layer's."""
        return torch.stack([torch.cat(calls, dim=1) for calls in self._calls], dim=2)


@dataclass
class RoutingStats:
    """Counts over the (token, layer) pairs a training forward saw with a recorded route: `agree` where the
    trainer's own router picked the same set of experts as the rollout's."""

    agree: int = 0
    total: int = 0

    def agreement(self) -> float | None:
        return self.agree / self.total if self.total else None


@dataclass
class Routing:
    """What a training forward does with an MoE rollout's routes: replay them (or only compare), counting
    the agreement into `stats`."""

    routes: torch.Tensor  # (N, T, L, k) over the forward's positions
    replay: bool
    stats: RoutingStats | None = None


@contextmanager
def replay_routes(
    model: torch.nn.Module,
    routes: torch.Tensor,
    valid: torch.Tensor,
    replay: bool = True,
    stats: RoutingStats | None = None,
):
    """Within the block, the model's forwards over (N, T) tokens route as `routes` (N, T, L, k) says where
    it recorded a route and `valid` (N, T) is 1 (replay=False: only count the agreement). Each layer's gate
    weights over the replayed experts are softmax(its own logits) taken at them (renormalised if the router
    does), so the router keeps its gradient. `stats` counts the agreement of the forward's own choice."""
    gates = routers(model)
    if routes.shape[2] != len(gates):
        raise ValueError(
            f"the recorded routes have {routes.shape[2]} MoE layers, the policy {len(gates)}: they were "
            "recorded by another model"
        )
    handles = []

    def hook(layer: int):
        def replayed(module, args, out):
            logits, weights, own = out
            given = routes[:, :, layer].reshape(-1, routes.shape[-1]).to(own.device, torch.long)
            use = (given[:, 0] != NOT_RECORDED) & valid.reshape(-1).bool().to(own.device)
            if stats is not None:
                same = (own.sort(-1).values == given.sort(-1).values).all(-1)
                stats.agree += int((same & use).sum())
                stats.total += int(use.sum())
            if not replay:
                return out
            index = torch.where(use[:, None], given, own)
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, index)
            if _normalises(module):
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, torch.where(use[:, None], probs.to(weights.dtype), weights), index

        return replayed

    try:
        for layer, gate in enumerate(gates):
            handles.append(gate.register_forward_hook(hook(layer)))
        yield
    finally:
        for h in handles:
            h.remove()
