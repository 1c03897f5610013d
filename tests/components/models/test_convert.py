"""`reinforge convert`: Hugging Face -> sharded for a mesh -> Hugging Face, bit-identical, on the tiny model and
a wider one; bad sources are one-line errors naming the flag."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from components.models import build_char_tokenizer, build_tiny_model
from components.models.loading import save_pretrained
from flows.convert import main


def hf_model(tmp_path, hidden: int, layers: int, heads: int, name: str):
    tok = build_char_tokenizer()
    model = build_tiny_model(
        tok,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=2 * hidden,
        max_positions=64,
        seed=3,
    )
    return save_pretrained(model, tok, tmp_path / name)


@pytest.mark.parametrize(
    "size, mesh",
    [((32, 1, 2), ("2", "1")), pytest.param((128, 3, 4), ("2", "2"), marks=pytest.mark.slow)],
    ids=["tiny-tp2", "wider-tp2xdp2"],
)
def test_a_round_trip_through_a_mesh_is_bit_identical(tmp_path, size, mesh):
    src = hf_model(tmp_path, *size, "hf")
    tp, dp = mesh
    args = ["--source", str(src), "--out", str(tmp_path / "sharded"), "--tensor-parallel", tp]
    assert main(["--to", "sharded", *args, "--data-parallel", dp]) == 0
    shards = sorted((tmp_path / "sharded" / "shards").glob("*.safetensors"))
    assert len(shards) == int(tp) * int(dp)  # one file per worker of the mesh
    assert main(["--to", "hf", "--source", str(tmp_path / "sharded"), "--out", str(tmp_path / "back")]) == 0
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "back" / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()


def test_bad_sources_are_one_line_errors_naming_the_flag(tmp_path, capsys):
    src = hf_model(tmp_path, 32, 1, 2, "hf")
    assert main(["--to", "hf", "--source", str(src), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --source={src}: no sharded model there") and err.count("\n") == 1, err
    bad = ["--to", "sharded", "--source", str(src), "--out", str(tmp_path / "y"), "--tensor-parallel", "4"]
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tensor-parallel=4 must divide the model's 2 attention heads"), err
