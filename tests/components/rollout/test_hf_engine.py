"""The hf engine: seeded, greedy-deterministic, bounded, log-probs equal to a fresh forward pass."""

import pytest
import torch

from components.errors import ConfigError
from components.rollout.base import make_engine
from components.rollout.hf import HFEngine
from components.rollout.sampling import filter_logits
from components.settings import SamplingParams
from components.training.logprobs import response_logprobs
from tests.conftest import make_model

PROMPTS = [[10, 11, 12], [13, 14], [15, 16, 17, 18]]


@pytest.fixture
def engine(tokenizer):
    return HFEngine(make_model(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)


def test_same_seed_same_samples_other_seed_differs(engine):
    p = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
    a, b, c = engine.generate(PROMPTS, p, 1), engine.generate(PROMPTS, p, 1), engine.generate(PROMPTS, p, 2)
    assert torch.equal(a.responses, b.responses)
    assert not torch.equal(a.responses, c.responses)


def test_greedy_is_deterministic_and_shapes(engine):
    p = SamplingParams(n=2, temperature=0.0, max_new_tokens=5)
    a, b = engine.generate(PROMPTS, p, 1), engine.generate(PROMPTS, p, 99)
    assert torch.equal(a.responses, b.responses)
    assert a.responses.shape[0] == 6 and a.responses.shape[1] <= 5
    assert torch.equal(a.responses[0], a.responses[1])  # both samples of prompt 0 are greedy


def test_logprobs_match_a_fresh_forward_pass(engine):
    from components.rollout.base import left_pad

    p = SamplingParams(n=2, temperature=0.8, max_new_tokens=6)
    out = engine.generate(PROMPTS, p, 3)
    prompts, pmask = left_pad(PROMPTS, engine.pad_id)
    with torch.no_grad():
        lp, _ = response_logprobs(
            engine.model,
            prompts.repeat_interleave(2, 0),
            pmask.repeat_interleave(2, 0),
            out.responses,
            out.response_mask,
            temperature=0.8,
        )
    torch.testing.assert_close(lp * out.response_mask, out.logprobs, atol=1e-5, rtol=0)


def test_stops_at_eos_and_masks_after_it(tokenizer):
    model = make_model(tokenizer)
    head = torch.nn.Linear(model.config.hidden_size, len(tokenizer), bias=True)
    with torch.no_grad():  # make EOS by far the most likely token
        head.weight.zero_()
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 20.0
    model.lm_head = head
    eng = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    out = eng.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=8), 0)
    assert out.responses.shape[1] == 1 and (out.responses[:, 0] == tokenizer.eos_token_id).all()
    assert out.response_mask.sum() == 3


def test_weight_updates_carry_a_growing_version(engine, tokenizer):
    other = make_model(tokenizer, seed=5)
    engine.update_weights(other.state_dict(), 3)
    assert engine.weights_version == 3
    with pytest.raises(ValueError, match="older"):
        engine.update_weights(other.state_dict(), 2)


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, 2, 1.0)[0, 2:]).all()
    kept = torch.isfinite(filter_logits(logits, 0, 0.7)[0])
    assert kept.tolist() == [True, True, False, False]  # softmax mass: 0.64, 0.24 -> first two reach 0.7


def test_unknown_engine_type_is_a_config_error():
    with pytest.raises(
        ConfigError, match="engine.type=mystery: unknown; available: hf, sglang, trtllm, vllm"
    ):
        make_engine("mystery", "unused", eos_id=1, pad_id=0)
