"""The one batch type that passes between stages: tensors + per-row Python values + meta.

Rows are aligned across every tensor's first dimension and every list in `non_tensors`. Ray ships a Batch
between processes as it ships any object; `to_bytes` writes it without pickle (safetensors for tensors, JSON
for the rest) where it must be stored.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, list] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: len(v) for k, v in {**self.tensors, **self.non_tensors}.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields have different row counts: {sizes}")

    def __len__(self) -> int:
        for v in (*self.tensors.values(), *self.non_tensors.values()):
            return len(v)
        return 0

    def select(self, index: list[int] | torch.Tensor) -> Batch:
        idx = torch.as_tensor(index, dtype=torch.long)
        rows = idx.tolist()
        return Batch(
            {k: v[idx] for k, v in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def chunk(self, n: int) -> list[Batch]:
        """n nearly equal consecutive parts."""
        bounds = torch.linspace(0, len(self), n + 1).round().long().tolist()
        return [self.select(list(range(a, b))) for a, b in zip(bounds, bounds[1:])]

    def repeat_interleave(self, n: int) -> Batch:
        return self.select(torch.arange(len(self)).repeat_interleave(n))

    def union(self, **tensors: torch.Tensor) -> Batch:
        return Batch({**self.tensors, **tensors}, dict(self.non_tensors), dict(self.meta))

    def with_non_tensors(self, **fields: list) -> Batch:
        return Batch(dict(self.tensors), {**self.non_tensors, **fields}, dict(self.meta))

    @staticmethod
    def concat(parts: list[Batch]) -> Batch:
        first = parts[0]
        return Batch(
            {k: torch.cat([p.tensors[k] for p in parts]) for k in first.tensors},
            {k: [x for p in parts for x in p.non_tensors[k]] for k in first.non_tensors},
            dict(first.meta),
        )

    def to_bytes(self) -> bytes:
        head = json.dumps({"non_tensors": self.non_tensors, "meta": self.meta}).encode()
        body = st_save({k: v.contiguous() for k, v in self.tensors.items()}) if self.tensors else b""
        return struct.pack("<Q", len(head)) + head + body

    @staticmethod
    def from_bytes(data: bytes) -> Batch:
        (n,) = struct.unpack("<Q", data[:8])
        head = json.loads(data[8 : 8 + n])
        body = data[8 + n :]
        return Batch(dict(st_load(body)) if body else {}, head["non_tensors"], head["meta"])
