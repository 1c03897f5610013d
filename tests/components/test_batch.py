"""The Batch type: row alignment, chunk/concat, and pickle-free serialisation."""

import pytest
import torch

from components.batch import Batch


def make(n=5):
    return Batch(
        {"x": torch.arange(n * 2).view(n, 2), "y": torch.rand(n)},
        {"s": [f"r{i}" for i in range(n)]},
        {"iteration": 3},
    )


def test_roundtrip_bytes():
    b = make()
    back = Batch.from_bytes(b.to_bytes())
    assert torch.equal(back.tensors["x"], b.tensors["x"]) and back.non_tensors == b.non_tensors
    assert back.meta == {"iteration": 3}


def test_chunk_concat_select_repeat():
    b = make(5)
    parts = b.chunk(2)
    assert [len(p) for p in parts] == [2, 3] or [len(p) for p in parts] == [3, 2]
    whole = Batch.concat(parts)
    assert torch.equal(whole.tensors["x"], b.tensors["x"]) and whole.non_tensors == b.non_tensors
    assert b.select([4, 0]).non_tensors["s"] == ["r4", "r0"]
    assert b.repeat_interleave(2).non_tensors["s"][:4] == ["r0", "r0", "r1", "r1"]


def test_misaligned_rows_rejected():
    with pytest.raises(ValueError, match="different row counts"):
        Batch({"x": torch.zeros(3)}, {"s": ["a"]})
