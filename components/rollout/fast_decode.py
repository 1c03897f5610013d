"""A lean sampling loop for Llama-family causal LMs (Qwen2, Llama, Mistral), used by the `hf` engine.

transformers' forward is general; per decoded token it rebuilds masks, grows its KV cache by concatenation and
calls q, k and v separately. Here, for the architectures whose layer is exactly RMSNorm -> attention with
rotary embeddings -> RMSNorm -> SiLU-gated MLP:
- the KV cache is allocated once, (rows, kv heads, prompt + max_new_tokens, head dim) per layer, and written in
  place; attention reads a view of its filled columns;
- q, k and v are one matmul (their weights concatenated at the start of each generate call: the only copy
  of the policy's weights this path makes);
- rows that finished (EOS) leave the batch once a quarter of the active rows have, so the matmuls shrink;
- the model's own modules supply the weights, the norms' epsilon and the rotary tables (its rope scaling
  included), so the logits equal transformers' own (tested to 1e-5).
Any other architecture falls back to transformers' forward (`unsupported_reason` says why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED = ("qwen2", "llama", "mistral")


def unsupported_reason(model) -> str | None:
    """Why the lean loop cannot run this model (None: it can)."""
    c = model.config
    if c.model_type not in SUPPORTED:
        return f"model_type {c.model_type!r} is not one of {', '.join(SUPPORTED)}"
    checks = {
        "hidden_act is not silu": getattr(c, "hidden_act", "silu") != "silu",
        "sliding-window attention": bool(
            getattr(c, "use_sliding_window", False) and getattr(c, "sliding_window", None)
        )
        or (c.model_type == "mistral" and getattr(c, "sliding_window", None) is not None),
        "mlp_bias": bool(getattr(c, "mlp_bias", False)),
        "pretraining_tp > 1": getattr(c, "pretraining_tp", 1) != 1,
        "dynamic rope scaling": (getattr(c, "rope_parameters", None) or {}).get("rope_type") == "dynamic",
        "no model.model.layers": not hasattr(getattr(model, "model", None), "layers"),
    }
    return next((why for why, bad in checks.items() if bad), None)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (N, H, T, D) with cos/sin (N, 1, T, D)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanDecoder:
    """Forward passes over a preallocated KV cache with the model's own weights (fused q/k/v excepted)."""

    def __init__(self, model):
        c = model.config
        self.model, self.layers = model, model.model.layers
        self.n_heads, self.n_kv = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self._packed: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def pack(self) -> None:
        """Concatenate each layer's q, k, v weights (and biases) as they are now (a copy of 3/8 or less of
        each layer's attention weights; milliseconds even for the 25M-parameter benchmark model)."""
        self._packed = []
        for layer in self.layers:
            projs = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
            w = torch.cat([p.weight for p in projs]).detach()
            b = None
            if any(p.bias is not None for p in projs):  # a missing bias is zeros
                b = torch.cat(
                    [
                        p.bias
                        if p.bias is not None
                        else torch.zeros(p.out_features, dtype=w.dtype, device=w.device)
                        for p in projs
                    ]
                ).detach()
            self._packed.append((w, b))

    def new_cache(
        self, rows: int, length: int, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape, device = (rows, self.n_kv, length, self.head_dim), self._device()
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in self.layers
        ]

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def rotary_table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (length, D) from the model's own rotary module."""
        pos = torch.arange(length, device=self._device())[None]
        cos, sin = self.model.model.rotary_emb(torch.zeros(1, dtype=dtype, device=pos.device), pos)
        return cos[0], sin[0]

    def _attend_one(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention of one query per row: q (N, H, 1, D), k/v (N, Hkv, T, D), mask (N, 1, 1, T) bool ->
        (N, H, 1, D). The H query heads are grouped over the Hkv heads as transformers groups them."""
        n, d = q.shape[0], self.head_dim
        qg = q.reshape(n, self.n_kv, self.n_heads // self.n_kv, d)  # (N, Hkv, G, D)
        scores = (qg @ k.transpose(-1, -2)) * d**-0.5  # (N, Hkv, G, T)
        scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ v).reshape(n, self.n_heads, 1, d)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        start: int,
        attn_mask: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Logits (N, V) of the last column. ids, positions (N, T) are written to cache columns
        [start, start + T); attn_mask (N, 1, T, start + T) bool says which keys each query sees."""
        n, t = ids.shape
        end = start + t
        h = self.model.model.embed_tokens(ids)
        cos, sin = rope[0][positions][:, None], rope[1][positions][:, None]  # (N, 1, T, D)
        hq, hk, d = self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.head_dim
        for layer, (w, b), (kc, vc) in zip(self.layers, self._packed, cache):
            ln = layer.input_layernorm
            x = F.rms_norm(h, (h.shape[-1],), ln.weight, ln.variance_epsilon)
            q, k, v = F.linear(x, w, b).split((hq, hk, hk), dim=-1)
            q = _rotate(q.view(n, t, self.n_heads, d).transpose(1, 2), cos, sin)
            kc[:, :, start:end] = _rotate(k.view(n, t, self.n_kv, d).transpose(1, 2), cos, sin)
            vc[:, :, start:end] = v.view(n, t, self.n_kv, d).transpose(1, 2)
            if t == 1:  # one new token: two small matmuls beat SDPA's kernel at this size (1.3 vs 2.0 ms, W2)
                a = self._attend_one(q, kc[:, :, :end], vc[:, :, :end], attn_mask)
            else:
                a = F.scaled_dot_product_attention(
                    q,
                    kc[:, :, :end],
                    vc[:, :, :end],
                    attn_mask=attn_mask,
                    enable_gqa=self.n_heads != self.n_kv,
                )
            h = h + layer.self_attn.o_proj(a.transpose(1, 2).reshape(n, t, hq))
            ln = layer.post_attention_layernorm
            x = F.rms_norm(h, (h.shape[-1],), ln.weight, ln.variance_epsilon)
            mlp = layer.mlp
            h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        norm = self.model.model.norm
        last = F.rms_norm(h[:, -1], (h.shape[-1],), norm.weight, norm.variance_epsilon)
        return self.model.lm_head(last)


def prefill_mask(mask: torch.Tensor) -> torch.Tensor:
    """(N, 1, P, P) bool: causal, padding keys hidden; a padding query sees itself (a row of no keys would be
    NaN, and its NaN keys would then poison the rows that mask them)."""
    p = mask.shape[1]
    causal = torch.ones(p, p, dtype=torch.bool, device=mask.device).tril()
    return (causal & mask.bool()[:, None, :]).logical_or(torch.eye(p, dtype=torch.bool, device=mask.device))[
        :, None
    ]
