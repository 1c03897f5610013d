"""The lean decode loop: the same logits as transformers' forward, the same greedy tokens as the hf loop,
exact log-probs when finished rows leave the batch, and a fallback for architectures it does not cover."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from components.rollout.fast_decode import LeanDecoder, prefill_mask, unsupported_reason
from components.rollout.hf import HFEngine, left_pad
from components.settings import SamplingParams
from components.training.logprobs import response_logprobs
from tests.conftest import make_model

PROMPTS = [[10, 11, 12], [13, 14], [15, 16, 17, 18], [19]]


def llama_gqa(vocab: int) -> LlamaForCausalLM:
    """Grouped-query attention (4 query heads over 2 kv heads), no q/k/v bias, untied head, scaled rope."""
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(params=["qwen2", "llama_gqa"])
def model(request, tokenizer):
    return make_model(tokenizer).eval() if request.param == "qwen2" else llama_gqa(len(tokenizer))


def test_logits_equal_transformers_prefill_and_each_decode_step(model, tokenizer):
    ids, mask = left_pad(PROMPTS, tokenizer.pad_token_id)
    lean = LeanDecoder(model)
    lean.pack()
    p, steps = ids.shape[1], 4
    cache, rope = (
        lean.new_cache(len(PROMPTS), p + steps, torch.float32),
        lean.rotary_table(p + steps, torch.float32),
    )
    keys = torch.cat([mask.bool(), torch.zeros(len(PROMPTS), steps, dtype=torch.bool)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = lean.forward(ids, positions, cache, 0, prefill_mask(mask), rope)
        full_ids, full_mask = ids, mask
        for t in range(steps):
            want = model(
                input_ids=full_ids,
                attention_mask=full_mask,
                position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0),
            ).logits[:, -1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            tok = want.argmax(-1)
            full_ids = torch.cat([full_ids, tok[:, None]], dim=1)
            full_mask = torch.cat([full_mask, torch.ones_like(mask[:, :1])], dim=1)
            keys[:, p + t] = True
            got = lean.forward(
                tok[:, None], positions[:, -1:] + 1 + t, cache, p + t, keys[:, None, None, : p + t + 1], rope
            )


def test_greedy_tokens_equal_the_transformers_loop(model, tokenizer):
    fast = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    slow = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, fast_decode=False)
    assert fast.lean is not None and slow.lean is None
    p = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
    a, b = fast.generate(PROMPTS, p, 0), slow.generate(PROMPTS, p, 0)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_rows_that_finish_leave_the_batch_and_logprobs_stay_exact(tokenizer):
    model = make_model(tokenizer).eval()
    with torch.no_grad():  # EOS likely enough that rows finish at different steps
        model.lm_head.weight[tokenizer.eos_token_id] = 0
        model.model.embed_tokens.weight[tokenizer.eos_token_id] = 0
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = 2.5
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(head.weight)
        model.lm_head.bias.copy_(bias)
    eng = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    rows_seen = []
    forward = eng.lean.forward
    eng.lean.forward = lambda ids, *a: rows_seen.append(len(ids)) or forward(ids, *a)
    p = SamplingParams(n=8, temperature=1.0, max_new_tokens=12)
    out = eng.generate(PROMPTS, p, 5)
    lengths = out.response_mask.sum(1)
    assert (
        lengths.min() < lengths.max() and (lengths < out.responses.shape[1]).sum() >= 8
    )  # rows finished early
    assert rows_seen[0] == 32 and min(rows_seen) < 32  # and were dropped from the batch
    prompts, pmask = left_pad(PROMPTS, tokenizer.pad_token_id)
    with torch.no_grad():
        lp, _ = response_logprobs(
            model,
            prompts.repeat_interleave(8, 0),
            pmask.repeat_interleave(8, 0),
            out.responses,
            out.response_mask,
        )
    torch.testing.assert_close(lp * out.response_mask, out.logprobs, atol=1e-5, rtol=0)
    again = eng.generate(PROMPTS, p, 5)
    assert torch.equal(again.responses, out.responses)  # seeded, row dropping included


def test_other_architectures_fall_back_to_transformers(tokenizer):
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    )
    assert "gpt2" in unsupported_reason(gpt2)
    eng = HFEngine(gpt2, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert eng.lean is None
    out = eng.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=4), 0)
    assert out.responses.shape == (4, 4)
