"""The resume fingerprint's model digest: any change to the starting model's files changes it."""

from __future__ import annotations

from components.lineage import model_digest
from components.validate import load_checked


def test_model_digest_follows_names_sizes_and_contents_even_of_big_files(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 32}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 64)  # 16 KiB, hashed by its edges below
    first = model_digest(model, whole_below=1024, edge=128)
    assert first == model_digest(model, whole_below=1024, edge=128) and len(first) == 32
    data = bytearray((model / "model.safetensors").read_bytes())
    data[-1] ^= 1  # the last byte: inside the hashed tail
    (model / "model.safetensors").write_bytes(bytes(data))
    second = model_digest(model, whole_below=1024, edge=128)
    (model / "config.json").write_text('{"vocab_size": 33}')
    third = model_digest(model, whole_below=1024, edge=128)
    assert len({first, second, third}) == 3
    assert model_digest(tmp_path / "missing") == ""


def test_a_new_sft_model_is_a_new_run(tmp_path):
    """A checkpoint of a run that started from another SFT model is not resumed (its vocabulary may differ)."""
    from tasks.tracking import run_fingerprint

    sft, data = tmp_path / "sft", tmp_path / "train.parquet"
    sft.mkdir()
    data.write_bytes(b"rows")
    (sft / "config.json").write_text("{}")
    cfg = load_checked(None, ["trainer.run_dir=/", f"actor.model.path={sft}", f"data.train_path={data}"])
    before = run_fingerprint(cfg)
    (sft / "config.json").write_text('{"vocab_size": 40}')
    after = run_fingerprint(cfg)
    assert after.digest != before.digest
    assert after.differences(before.state()) == [
        f"actor.model.path: {before.inputs['actor.model.path']!r} -> {after.inputs['actor.model.path']!r}"
    ]
