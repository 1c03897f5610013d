"""Tokenizers come back exactly as they were saved; model directories that cannot load fail with a message."""

import json

import pytest
import torch

from components.errors import ConfigError
from components.models import (
    build_char_tokenizer,
    build_tiny_model,
    load_model,
    load_tokenizer,
    save_pretrained,
)
from components.models.loading import PROBES

CORPUS = [
    "Q: 25+60=? A: #### 85",
    "two\nlines\n\n with  spaces ",
    "(3 * 4) - 7 / 2 = 8.5, isn't it?",
    "#### 1,234$ <eos> <pad>",
    "café 中文 🙂 １＋２＝ \x00 \u200f",
    *PROBES,
]


def tiny(tok, seed=0):
    return build_tiny_model(
        tok, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=64, seed=seed
    )


def reward_model(tok):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    return Qwen2ForSequenceClassification(config)


def assert_same_text(saved, loaded):
    for text in CORPUS:
        ids = saved(text, add_special_tokens=False)["input_ids"]
        assert loaded(text, add_special_tokens=False)["input_ids"] == ids, text
        if saved.unk_token_id not in ids:
            assert loaded.decode(ids) == text
    assert loaded.chat_template == saved.chat_template
    assert (loaded.pad_token_id, loaded.eos_token_id) == (saved.pad_token_id, saved.eos_token_id)


@pytest.mark.parametrize("tool_tokens", [False, True])
@pytest.mark.parametrize("kind", ["policy", "reward_model"])
def test_every_model_directory_we_write_reloads_its_tokenizer_exactly(tmp_path, tool_tokens, kind):
    """SFT, the GRPO final model, checkpoints and benchmark models are policies saved by save_pretrained; the
    reward model is a sequence classifier saved by it. A Qwen2 config must not swap our tokenizer for
    Qwen2's byte-level one (which dropped every space and newline)."""
    tok = build_char_tokenizer(tool_tokens=tool_tokens)
    save_pretrained(tiny(tok) if kind == "policy" else reward_model(tok), tok, tmp_path / "m")
    assert_same_text(tok, load_tokenizer(tmp_path / "m"))


def test_the_pipelines_model_directories_keep_spaces(tmp_path):
    """What issue 17 saw: `Q: 25+60=? A: #### 85` came back as the ids of `Q:25+60=?A:####85`."""
    tok = build_char_tokenizer()
    save_pretrained(tiny(tok), tok, tmp_path / "sft")
    loaded = load_tokenizer(tmp_path / "sft")
    ids = loaded("Q: 25+60=? A: #### 85", add_special_tokens=False)["input_ids"]
    assert loaded.decode(ids) == "Q: 25+60=? A: #### 85" and len(ids) == len("Q: 25+60=? A: #### 85")


def test_a_class_that_rebuilds_the_tokenizer_differently_fails_naming_the_directory(tmp_path):
    tok = build_char_tokenizer()
    save_pretrained(tiny(tok), tok, tmp_path / "m")
    config = tmp_path / "m" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "Qwen2Tokenizer"}))
    with pytest.raises(
        ConfigError,
        match=rf"actor\.model\.path={tmp_path}/m: the tokenizer transformers loads "
        r"\(Qwen2Tokenizer\) encodes .* differently from the saved tokenizer\.json",
    ):
        load_tokenizer(tmp_path / "m")


def _qwen2_style_tokenizer():
    """A byte-level BPE with Qwen2's own pre-tokenizer, trained here (nothing is downloaded), as a real Qwen2.5
    directory holds it: tokenizer_class Qwen2Tokenizer."""
    from tokenizers import Tokenizer, models, trainers
    from transformers import Qwen2Tokenizer

    base = Qwen2Tokenizer()  # Qwen2's normalizer, pre-tokenizer and decoder
    raw = Tokenizer(models.BPE())
    raw.normalizer, raw.pre_tokenizer = (
        base.backend_tokenizer.normalizer,
        base.backend_tokenizer.pre_tokenizer,
    )
    raw.decoder = base.backend_tokenizer.decoder
    from tokenizers import pre_tokenizers

    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(CORPUS * 20 + ["Natalia sold clips to 48 of her friends in April."] * 20, trainer)
    vocab = raw.get_vocab()
    merges = [
        tuple(m) if isinstance(m, list) else tuple(m.split(" "))
        for m in json.loads(raw.to_str())["model"]["merges"]
    ]
    return Qwen2Tokenizer(vocab=vocab, merges=merges)


def test_a_real_models_own_tokenizer_class_is_kept(tmp_path):
    tok = _qwen2_style_tokenizer()
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
    save_pretrained(tiny(build_char_tokenizer()), tok, tmp_path / "qwen")
    loaded = load_tokenizer(tmp_path / "qwen")
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    for text in CORPUS:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]


def test_a_model_directory_without_weights_or_with_pickle_only_is_named(tmp_path):
    tok = build_char_tokenizer()
    save_pretrained(tiny(tok), tok, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.unlink()
    with pytest.raises(ConfigError, match=r"actor\.model\.path=.*: config\.json is there but no weights"):
        load_model(tmp_path / "m")
    torch.save({"x": torch.zeros(1)}, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(
        ConfigError,
        match=r"weights are only in pickle format \(pytorch_model\.bin\).*"
        r"safe_serialization=True",
    ):
        load_model(tmp_path / "m")
