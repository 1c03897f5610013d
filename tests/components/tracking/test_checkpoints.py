"""Checkpoints: atomic directory, manifest checksums, the latest pointer, no pickle."""

import json

import pytest
import torch

from components.errors import CheckpointError
from components.models import save_pretrained
from components.tracking import checkpoints
from tests.conftest import make_model


def write(root, it, tokenizer, opt_state=None):
    model = make_model(tokenizer, seed=it)
    return checkpoints.save_checkpoint(root, it, lambda out: save_pretrained(model, tokenizer, out),
                                       {"sampler": {"epoch": 0, "cursor": it}}, opt_state, keep=2), model


def test_save_verify_latest_and_prune(tmp_path, tokenizer):
    for it in (1, 2, 3):
        path, _ = write(tmp_path, it, tokenizer)
    assert checkpoints.latest(tmp_path) == path
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_000002", "iter_000003"]
    assert not list(tmp_path.glob(".tmp_*"))
    state, opt = checkpoints.load_state(path)
    assert state["iteration"] == 3 and state["sampler"]["cursor"] == 3 and opt is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_corruption_is_detected(tmp_path, tokenizer, damage):
    path, _ = write(tmp_path, 1, tokenizer)
    target = path / "model" / "model.safetensors"
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(bytes(data[:100]))
    else:
        target.unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        checkpoints.latest(tmp_path)


def test_pointer_to_nothing(tmp_path, tokenizer):
    write(tmp_path, 1, tokenizer)
    (tmp_path / "latest").write_text("iter_999999\n")
    with pytest.raises(CheckpointError, match="no manifest.json"):
        checkpoints.latest(tmp_path)


def test_optimizer_state_roundtrips_without_pickle(tmp_path, tokenizer):
    model = make_model(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]])).loss.backward()
    opt.step()
    path, _ = write(tmp_path, 1, tokenizer, opt.state_dict())
    _, restored = checkpoints.load_state(path)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(restored)
    for pid, slots in opt.state_dict()["state"].items():
        for k, v in slots.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(fresh.state_dict()["state"][pid][k]))
    assert json.loads((path / "manifest.json").read_text())["files"]["optimizer.safetensors"]


def test_failed_save_leaves_previous_checkpoint(tmp_path, tokenizer):
    good, _ = write(tmp_path, 1, tokenizer)

    def boom(out):
        out.mkdir(parents=True)
        (out / "partial").write_text("x")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        checkpoints.save_checkpoint(tmp_path, 2, boom, {})
    assert checkpoints.latest(tmp_path) == good
    assert not list(tmp_path.glob(".tmp_*")) and not (tmp_path / "iter_000002").exists()
