"""Both prompt forms reach the model as the same ids in SFT and in the rollout engine."""

import pytest
import torch
from tokenizers.processors import TemplateProcessing

from components.data.prompts import encode_prompt, render_prompt
from components.models import build_char_tokenizer, build_tiny_model, save_pretrained
from components.rollout.worker import RolloutWorker
from components.settings import PromptSettings, SamplingParams
from components.training.sft import encode_examples

MESSAGES = [{"role": "user", "content": "12 + 34 ="}]
TEXT = "12 + 34 ="


def bos_tokenizer(template: bool):
    """The character tokenizer with a BOS its post-processor adds (as Llama's does), with or without a chat
    template (a base model has none)."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"bos_token": "<bos>"})
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)]
    )
    if not template:
        tok.chat_template = None
    return tok


def saved(tmp_path, tok):
    model = build_tiny_model(
        tok, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=64, seed=0
    )
    return save_pretrained(model, tok, tmp_path / "model")


def rollout_prompt_ids(model_dir, prompt, settings) -> list[int]:
    worker = RolloutWorker(str(model_dir), prompts=settings)
    row = {"prompt": prompt, "reward_model": {"ground_truth": "46"}, "data_source": "arith", "extra_info": {}}
    batch = worker.generate(
        [row], SamplingParams(n=1, temperature=0.0, max_new_tokens=2), seed=0, iteration=-1
    )
    return batch.tensors["prompts"][0][batch.tensors["prompt_mask"][0].bool()].tolist()


# (tokenizer has a chat template, prompt, data.apply_chat_template): every combination that is not a config error
CASES = [
    (True, MESSAGES, None),
    (True, MESSAGES, True),
    (True, TEXT, None),
    (True, TEXT, True),
    (True, TEXT, False),
    (False, TEXT, None),
    (False, TEXT, False),
]


@pytest.mark.parametrize("template,prompt,apply", CASES)
def test_sft_and_rollout_see_the_same_prompt_ids(tmp_path, template, prompt, apply):
    tok = bos_tokenizer(template)
    settings = PromptSettings(apply)
    model_dir = saved(tmp_path, tok)
    (sft,) = encode_examples(tok, [prompt], ["#### 46"], settings)
    assert rollout_prompt_ids(model_dir, prompt, settings) == sft.prompt_ids
    if settings.templated("messages" if isinstance(prompt, list) else "text"):
        assert tok.bos_token_id not in sft.prompt_ids  # the template writes the text; nothing is added to it
    else:
        assert sft.prompt_ids[0] == tok.bos_token_id  # a plain string gets the tokenizer's own special tokens
        assert tok.decode(sft.prompt_ids[1:]) == TEXT


def test_rendering_follows_apply_chat_template():
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    assert render_prompt(tok, TEXT, PromptSettings()) == TEXT
    assert render_prompt(tok, TEXT, PromptSettings(True)) == "<user>12 + 34 =<assistant>"
    assert render_prompt(tok, MESSAGES, PromptSettings()) == "<user>12 + 34 =<assistant>"
    ids = encode_prompt(tok, TEXT, PromptSettings())
    assert tok.decode(ids) == TEXT and torch.tensor(ids).numel() == len(TEXT)
