"""Checkpoints: atomic directory, manifest checksums, the latest pointer, no pickle."""

import json

import pytest
import torch

from components.errors import CheckpointError, ConfigError, OutputError
from components.models import save_pretrained
from components.tracking import checkpoints
from tests.conftest import make_model


def write(root, it, tokenizer, opt_state=None, keep=2):
    model = make_model(tokenizer, seed=it)

    def files(out):
        save_pretrained(model, tokenizer, out / "model")
        if opt_state is not None:
            checkpoints.save_optimizer(out, "optimizer", opt_state)

    return checkpoints.save_checkpoint(
        root, it, files, {"sampler": {"epoch": 0, "cursor": it}}, keep=keep
    ), model


def test_save_verify_latest_and_prune(tmp_path, tokenizer):
    for it in (1, 2, 3):
        path, _ = write(tmp_path, it, tokenizer)
    assert checkpoints.latest(tmp_path) == path
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_000002", "iter_000003"]
    assert not list(tmp_path.glob(".tmp_*"))
    state, opt = checkpoints.load_state(path)
    assert state["iteration"] == 3 and state["sampler"]["cursor"] == 3 and opt is None


def damage_file(target, how: str) -> None:
    """Flip one bit in the middle, cut the file in half, or remove it."""
    data = bytearray(target.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif how == "truncate":
        target.write_bytes(bytes(data[: len(data) // 2]))
    else:
        target.unlink()


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_corruption_is_detected(tmp_path, tokenizer, damage):
    path, _ = write(tmp_path, 1, tokenizer)
    damage_file(path / "model" / "model.safetensors", damage)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        checkpoints.latest(tmp_path)


def test_pointer_to_nothing(tmp_path, tokenizer):
    write(tmp_path, 1, tokenizer)
    (tmp_path / "latest").write_text("iter_999999\n")
    with pytest.raises(CheckpointError, match="iter_999999: not a checkpoint directory"):
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
        (out / "partial").write_text("x")
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputError, match="no space left on the device of .* writing checkpoint iter_000002"):
        checkpoints.save_checkpoint(tmp_path, 2, boom, {})
    assert checkpoints.latest(tmp_path) == good
    assert not list(tmp_path.glob(".tmp_*")) and not (tmp_path / "iter_000002").exists()


# ---- faults: a save killed halfway, corruption with fallback, a pickle payload ---------------------------------


def test_save_killed_midway_keeps_previous_and_resume_cleans_up(tmp_path, tokenizer):
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    good, _ = write(tmp_path, 1, tokenizer)
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from components.tracking import checkpoints

        def files(out):
            (out / "model").mkdir()
            (out / "model" / "model.safetensors").write_bytes(b"half a file")
            os.kill(os.getpid(), signal.SIGKILL)  # the process dies after the first file, before the commit

        checkpoints.save_checkpoint({str(tmp_path)!r}, 2, files, {{}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert list(tmp_path.glob(".tmp_iter_000002_*")), "the partial save should be on disk"
    assert checkpoints.latest(tmp_path) == good  # the pointer never moved
    ckpt, _ = checkpoints.find_resumable(tmp_path)
    assert ckpt == good and not list(tmp_path.glob(".tmp_*")) and not (tmp_path / "iter_000002").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "pointer"])
def test_resume_falls_back_to_the_last_good_checkpoint(tmp_path, tokenizer, damage):
    good, _ = write(tmp_path, 1, tokenizer, keep=None)
    bad, _ = write(tmp_path, 2, tokenizer, keep=None)
    if damage == "pointer":
        import shutil

        shutil.rmtree(bad)  # `latest` now names a directory that is gone
    else:
        damage_file(bad / "model" / "model.safetensors", damage)
    ckpt, passed_over = checkpoints.find_resumable(tmp_path)
    assert ckpt == good
    assert passed_over and ("sha256" in passed_over[0] or "does not exist" in passed_over[0])


def test_no_good_checkpoint_stops_with_a_clear_error(tmp_path, tokenizer):
    path, _ = write(tmp_path, 1, tokenizer)
    (path / "state.json").write_text("{}")
    with pytest.raises(
        CheckpointError, match="no checkpoint under .* verifies: .*state.json fails its sha256"
    ):
        checkpoints.find_resumable(tmp_path)


def test_other_config_is_not_resumed(tmp_path, tokenizer):
    write(tmp_path, 1, tokenizer)
    ckpt, passed_over = checkpoints.find_resumable(tmp_path, fingerprint="another config")
    assert ckpt is None and "different config" in passed_over[0]


class _Payload:
    """Unpickling this runs its side effect: what an attacker would put in a checkpoint file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_in_a_checkpoint_is_refused_and_never_runs(tmp_path, tokenizer):
    import hashlib
    import pickle

    from components.models.loading import load_model

    opt = torch.optim.AdamW(make_model(tokenizer).parameters())
    path, _ = write(tmp_path, 1, tokenizer, opt.state_dict())
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(str(marker)))
    weights = path / "model" / "model.safetensors"
    weights.unlink()
    (path / "model" / "pytorch_model.bin").write_bytes(payload)  # a pickle where the weights should be
    (path / "optimizer.safetensors").write_bytes(payload)
    manifest = json.loads((path / "manifest.json").read_text())  # the attacker fixes the manifest too
    manifest["files"].pop("model/model.safetensors")
    manifest["files"]["model/pytorch_model.bin"] = hashlib.sha256(payload).hexdigest()
    manifest["files"]["optimizer.safetensors"] = hashlib.sha256(payload).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    # the checksums match, but the manifest lists no weights and a pickle-format file: refused before loading
    with pytest.raises(CheckpointError, match="model/pytorch_model.bin is a pickle-format file"):
        checkpoints.verify(path)
    with pytest.raises(CheckpointError):
        checkpoints.load_state(path)
    with pytest.raises(ConfigError, match="weights are only in pickle format"):
        load_model(path / "model", safetensors_only=True)
    assert not marker.exists()


# ---- tampering a careless or hostile user tried: each is refused, and resume falls back ------------------------


def _rewrite_manifest(ckpt, change):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    change(manifest["files"])
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _symlink_in(ckpt, tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    (ckpt / "worker.json").symlink_to(secret)  # a file outside the checkpoint, listed with its real sha256
    _rewrite_manifest(ckpt, lambda files: files.update({"worker.json": checkpoints.sha256(secret)}))
    return "worker.json is a symlink"


def _dotdot_entry(ckpt, tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    _rewrite_manifest(ckpt, lambda files: files.update({"../outside.json": checkpoints.sha256(outside)}))
    return r"names '\.\./outside\.json', which is not a plain path"


def _weights_entry_removed(ckpt, tmp_path):
    _rewrite_manifest(ckpt, lambda files: files.pop("model/model.safetensors"))
    (ckpt / "model" / "model.safetensors").write_bytes(b"other weights")  # then the weights replaced
    return r"model/model\.safetensors is not in its manifest\.json"


def _truncated_manifest(ckpt, tmp_path):
    text = (ckpt / "manifest.json").read_text()
    (ckpt / "manifest.json").write_text(text[: len(text) // 2])
    return r"manifest\.json is malformed \(JSONDecodeError\)"


def _state_missing(ckpt, tmp_path):
    (ckpt / "state.json").unlink()
    return "state.json is missing"


@pytest.mark.parametrize(
    "tamper",
    [_symlink_in, _dotdot_entry, _weights_entry_removed, _truncated_manifest, _state_missing],
    ids=lambda f: f.__name__.strip("_"),
)
def test_tampering_is_refused_and_resume_falls_back_to_the_last_good_checkpoint(tmp_path, tokenizer, tamper):
    root = tmp_path / "ckpts"
    good, _ = write(root, 1, tokenizer, keep=None)
    bad, _ = write(root, 2, tokenizer, keep=None)
    message = tamper(bad, tmp_path)
    with pytest.raises(CheckpointError, match=message):
        checkpoints.verify(bad)
    ckpt, passed_over = checkpoints.find_resumable(root)
    assert ckpt == good and any("iter_000002" in p for p in passed_over), passed_over


def test_latest_naming_anything_but_a_sibling_checkpoint_is_ignored(tmp_path, tokenizer):
    root, other = tmp_path / "ckpts", tmp_path / "other"
    good, _ = write(root, 1, tokenizer)
    write(other, 5, tokenizer)
    (root / "latest").write_text("../other/iter_000005\n")
    with pytest.raises(CheckpointError, match="does not name a checkpoint of"):
        checkpoints.latest(root)
    ckpt, passed_over = checkpoints.find_resumable(root)
    assert ckpt == good and "does not name a checkpoint" in passed_over[0]


def test_pruning_never_removes_the_new_checkpoint_or_a_newer_one(tmp_path, tokenizer):
    for it in (1, 2, 5):
        write(tmp_path, it, tokenizer, keep=None)
    path, _ = write(tmp_path, 3, tokenizer, keep=1)  # resumed from 2 after 5 went bad: 3 is the newest save
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_000003", "iter_000005"]
    assert checkpoints.latest(tmp_path) == path
