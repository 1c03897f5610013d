"""The OpenAI-compatible endpoint: a real `openai` client's agent runs an episode of two requests; the
episode's tokens are the sampled ids themselves (token in, token out), its agent turns masked out."""

from __future__ import annotations

import openai
import pytest

from components.envs.agent import AgentServer
from components.rollout.multi_turn import turns_after_reply
from components.settings import SamplingParams
from tests.components.rollout.test_multi_turn import ScriptedEngine


@pytest.fixture
def tokenizer():
    from components.models import build_char_tokenizer

    return build_char_tokenizer()


def agent(base_url: str) -> float:
    """A user's agent program: it asks, reads the reply, asks again with the conversation, and scores."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "6*7="}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}]
    messages += [{"role": "user", "content": "sure?"}]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return 1.0 if second.choices[0].message.content.strip() == "42" else 0.0


def test_an_agents_episode_is_the_tokens_sampled_and_its_own_turns_masked(tokenizer):
    engine = ScriptedEngine(tokenizer, [["41"], ["42"]])
    with AgentServer(engine, tokenizer, SamplingParams(max_new_tokens=16), seed=0) as server:
        reward = agent(server.base_url("e0"))
        ep = server.episode("e0")
    assert reward == 1.0 and ep.calls == 2
    eos = tokenizer.eos_token_id
    first, second = (tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in ("41", "42"))
    between = tokenizer(
        turns_after_reply(tokenizer, [{"role": "user", "content": "sure?"}], True), add_special_tokens=False
    )["input_ids"]
    assert ep.tokens == first + between + second  # the replies' ids as sampled, never tokenized again
    assert ep.loss == [1] * len(first) + [0] * len(between) + [1] * len(second)
    assert ep.logprobs == [-0.5] * len(first) + [0.0] * len(between) + [-0.5] * len(second)
    assert engine.seen[1][0] == ep.prompt + first + between  # the second request continued the held ids


def test_a_request_that_rewrites_the_conversation_is_refused(tokenizer):
    engine = ScriptedEngine(tokenizer, [["41"], ["42"]])
    with AgentServer(engine, tokenizer, SamplingParams(max_new_tokens=16), seed=0) as server:
        client = openai.OpenAI(base_url=server.base_url("e1"), api_key="x", max_retries=0, timeout=30)
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "6*7="}])
        edited = [{"role": "user", "content": "6*7="}, {"role": "assistant", "content": "42"}]
        with pytest.raises(openai.BadRequestError, match="repeat the conversation so far"):
            client.chat.completions.create(model="p", messages=[*edited, {"role": "user", "content": "ok"}])
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(
                base_url=server.base_url("e2").replace("/v1", "/v2"), api_key="x", max_retries=0
            ).chat.completions.create(model="p", messages=[{"role": "user", "content": "1"}])


def test_the_recorded_log_probs_are_the_policys_own_on_those_tokens(tokenizer):
    """With the hf engine on a tiny model: the log-probs the episode recorded for its sampled tokens equal the
    policy's on the same ids in a training forward pass (no re-tokenisation drift between rollout and update)."""
    import torch

    from components.rollout.hf import HFEngine
    from components.training.logprobs import response_logprobs
    from tests.conftest import make_model

    model = make_model(tokenizer).eval()
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    with AgentServer(engine, tokenizer, SamplingParams(max_new_tokens=8, temperature=1.0), seed=3) as server:
        agent(server.base_url("e0"))
        ep = server.episode("e0")
    prompts = torch.tensor([ep.prompt])
    responses = torch.tensor([ep.tokens])
    attention = torch.ones_like(responses)
    full, _ = response_logprobs(model, prompts, torch.ones_like(prompts), responses, attention)
    sampled = torch.tensor(ep.loss).bool()
    assert sampled.sum() > 0 and (~sampled).sum() > 0  # both replies and the agent's turn are there
    torch.testing.assert_close(full[0][sampled], torch.tensor(ep.logprobs)[sampled], atol=1e-4, rtol=1e-4)
