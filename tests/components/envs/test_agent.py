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


def test_an_agent_program_plays_its_episodes_through_the_rollout(tokenizer):
    """multi_turn.env=agent: agents/guess_number.py, through the real openai client, plays two episodes of one
    row; the rollout samples each turn (both episodes' first turns in one generate call), the agent's moves
    are its observations, masked out, and its return value is each episode's reward."""
    import random

    from components.envs.base import episode_factory
    from components.rollout.multi_turn import first_messages, play_episodes, tool_turn_text
    from components.seeding import derive_seed
    from components.settings import MultiTurnSettings

    target = random.Random(derive_seed(0, "episode", 0)).randint(0, 9)
    wrong = (target + 5) % 10
    settings = MultiTurnSettings(
        2, (), 64, env="agent", agent="agents/guess_number.py:play", eos_token=tokenizer.eos_token
    )
    make = episode_factory("agent", settings)
    envs = [make(), make()]
    rows = first_messages([{"prompt": "ignored"}], envs, 2, seed=0, env_name="agent")
    opening = rows[0]["prompt"]
    assert opening == [{"role": "user", "content": "Guess my number, 0 to 9. Answer with one digit."}]
    engine = ScriptedEngine(tokenizer, [[str(target), str(wrong)], [str(wrong)]])
    prompt = tokenizer("g", add_special_tokens=False)["input_ids"]
    mt = play_episodes(
        engine, tokenizer, [prompt], SamplingParams(n=2), 0, envs, 2, env_name="agent", step_timeout_s=30
    )
    assert mt.rewards.tolist() == [1.0, 0.0] and mt.num_turns.tolist() == [1.0, 2.0]
    eos = tokenizer.eos_token_id
    guess = tokenizer(str(wrong), add_special_tokens=False)["input_ids"] + [eos]
    move = "higher" if wrong < target else "lower"
    between = tokenizer(tool_turn_text(tokenizer, move, True, "user"), add_special_tokens=False)["input_ids"]
    row = mt.out.responses[1][mt.attention_mask[1].bool()].tolist()
    assert row == guess + between + guess  # the sampled ids, the agent's move rendered between them
    assert mt.out.response_mask[1, : len(row)].tolist() == [1] * len(guess) + [0] * len(between) + [1] * len(
        guess
    )


def test_an_agent_that_raises_stops_the_rollout_naming_the_episode(tokenizer, tmp_path):
    from components.envs.agent import AgentEpisode
    from components.errors import RewardError
    from components.rewards.custom import CustomReward
    from components.rollout.multi_turn import first_messages, play_episodes

    source = """
from openai import OpenAI

def play(base_url, row, seed):
    client = OpenAI(base_url=base_url, api_key="x", max_retries=0)
    client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
    if seed >= 0:
        raise KeyError("score")
"""
    agent = CustomReward("a.py", str(tmp_path / "a.py"), "play", source)
    envs = [AgentEpisode(agent, tokenizer.eos_token)]
    first_messages([{"prompt": "x"}], envs, 1, seed=0, env_name="agent")
    engine = ScriptedEngine(tokenizer, [["1"]])
    with pytest.raises(
        RewardError, match=r"environment agent, episode 0, turn 1: step: raised KeyError\('score'\)"
    ):
        play_episodes(engine, tokenizer, [[5]], SamplingParams(n=1), 0, envs, 2, env_name="agent")


def test_the_config_refuses_an_agent_that_is_not_a_program_of_the_project(tmp_path):
    from components.config import load_config
    from components.envs.agent import check_agent
    from components.errors import ConfigError

    agent = ("multi_turn.enable=true", "multi_turn.env=agent")
    with pytest.raises(
        ConfigError,
        match=r"multi_turn.agent names the agent program of the agent environment \(multi_turn.env=agent",
    ):
        load_config("configs/arith_grpo.yaml", list(agent))
    with pytest.raises(
        ConfigError, match=r"multi_turn.agent='agents/guess_number.py': give the agent as file.py:function"
    ):
        load_config("configs/arith_grpo.yaml", [*agent, "multi_turn.agent=agents/guess_number.py"])
    cfg = load_config("configs/arith_grpo.yaml", [*agent, "multi_turn.agent=agents/guess_number.py:guess"])
    with pytest.raises(
        ConfigError, match=r"multi_turn.agent=guess: agents/guess_number.py defines no function 'guess'"
    ):
        check_agent(cfg)
    cfg = load_config("configs/arith_grpo.yaml", [*agent, "multi_turn.agent=agents/guess_number.py:play"])
    check_agent(cfg)  # the shipped example: imports in a process of its own, takes (base_url, row, seed)
