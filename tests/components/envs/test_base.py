"""The environment interface: an episode's turns, masks, observations and reward, exactly."""

from __future__ import annotations

import math

import pytest
import torch

from components.envs.base import INVALID, Step, checked_reward, episode_factory
from components.errors import RewardError
from components.rollout.multi_turn import first_messages, play_episodes, tool_turn_text
from components.settings import SamplingParams
from tests.components.rollout.test_multi_turn import ScriptedEngine


@pytest.fixture
def tokenizer():
    from components.models import build_char_tokenizer

    return build_char_tokenizer(tool_tokens=True)


class Guess:
    """A game: guess 7. A wrong guess is answered `higher` or `lower` as the user's next message; the right
    one ends the episode with reward 1, running out of turns with 0."""

    def reset(self, row: dict, seed: int) -> list[dict]:
        return [{"role": "user", "content": "guess 0-9"}]

    def step(self, text: str, last_turn: bool) -> Step:
        guess = text.strip().rstrip("\x00")[:1]
        if guess == "7":
            return Step(reward=1.0, done=True, counts={"guesses": 1.0})
        if last_turn:
            return Step(reward=0.0, done=True, counts={"guesses": 1.0})
        return Step("higher" if guess < "7" else "lower", role="user", counts={"guesses": 1.0})


def test_an_episode_appends_each_observation_masked_and_ends_with_its_reward(tokenizer):
    engine = ScriptedEngine(tokenizer, [["5", "7", "9"], ["7", "8"]])
    envs = [Guess() for _ in range(3)]
    rows = first_messages([{"prompt": "ignored"}], envs, 3, seed=0)
    assert rows == [{"prompt": [{"role": "user", "content": "guess 0-9"}]}]
    prompt = tokenizer("g", add_special_tokens=False)["input_ids"]
    mt = play_episodes(
        engine, tokenizer, [prompt], SamplingParams(n=3), 0, envs, max_turns=2, env_name="guess"
    )
    assert mt.num_turns.tolist() == [2, 1, 2] and mt.rewards.tolist() == [1.0, 1.0, 0.0]
    assert mt.counts["guesses"].tolist() == [2, 1, 2]
    eos = tokenizer.eos_token_id
    five, seven = (tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in ("5", "7"))
    higher = tokenizer(tool_turn_text(tokenizer, "higher", True, "user"), add_special_tokens=False)[
        "input_ids"
    ]
    row = mt.out.responses[0][mt.attention_mask[0].bool()].tolist()
    assert row == five + higher + seven  # the game's move as a user turn between the model's two
    assert mt.out.response_mask[0, : len(row)].tolist() == [1] * len(five) + [0] * len(higher) + [1] * len(
        seven
    )
    assert engine.seen[1][0] == prompt + five + higher  # turn 2 saw turn 1 and the game's answer


def test_tool_calling_is_an_environment():
    env = episode_factory("tools")()
    assert env.reset({"prompt": "x"}, 0) is None
    assert env.step("#### 4", last_turn=False).ends
    with pytest.raises(
        ValueError, match="multi_turn.env='nope': no such environment; valid: agent, single, textarena, tools"
    ):
        episode_factory("nope")


@pytest.mark.parametrize("bad", [math.nan, math.inf, 1e9, "1", True])
def test_a_reward_that_is_not_a_finite_number_in_range_is_invalid_naming_the_episode(bad, caplog):
    assert checked_reward("guess", 3, bad) == INVALID
    (said,) = caplog.messages
    assert said.startswith(f"environment guess, episode 3: reward {bad!r} ") and said.endswith(
        "counted invalid"
    )
    assert checked_reward("guess", 3, 0.5) == 0.5 and checked_reward("guess", 3, None) is None


def test_invalid_environment_rewards_are_counted_by_max_invalid_frac():
    from components.batch import Batch
    from components.rl import score_responses
    from components.settings import RewardSettings

    batch = Batch(
        {"env_reward": torch.tensor([1.0, INVALID, 0.0, 0.0])},
        {"ground_truth": ["a"] * 4, "data_source": ["s"] * 4, "extra_info": [{}] * 4},
    )

    def score(texts, truths, sources, extras):
        return [1.0] * 4, [True] * 4, {}  # every row scorable: only the environment's reward is invalid

    scored = score_responses(batch, ["x"] * 4, score, RewardSettings((8, 0, 1.0), max_invalid_frac=0.25))
    assert scored.scores.tolist() == [1.0, 0.0, 0.0, 0.0] and scored.valid == [True, False, True, True]
    assert scored.metrics["reward/invalid_count"] == 1.0
    with pytest.raises(RewardError, match="1 of 4 rewards are invalid"):
        score_responses(batch, ["x"] * 4, score, RewardSettings((8, 0, 1.0), max_invalid_frac=0.2))


def test_an_environment_that_hangs_stops_the_rollout_naming_it(tokenizer):
    import threading
    import time

    release = threading.Event()

    class Stuck(Guess):
        def step(self, text, last_turn):
            release.wait(30)  # a game waiting for input that never comes
            return Step(reward=0.0, done=True)

    engine = ScriptedEngine(tokenizer, [["5"]])
    start = time.monotonic()
    try:
        with pytest.raises(
            RewardError,
            match=r"environment guess, episode 0, turn 1: step: no answer within multi_turn.step_timeout_s=0.5 s",
        ):
            play_episodes(
                engine,
                tokenizer,
                [[5]],
                SamplingParams(n=1),
                0,
                [Stuck()],
                2,
                env_name="guess",
                step_timeout_s=0.5,
            )
        assert time.monotonic() - start < 5
    finally:
        release.set()


def test_a_reset_that_hangs_names_the_episode():
    import threading

    release = threading.Event()

    class Stuck(Guess):
        def reset(self, row, seed):
            release.wait(30)

    try:
        with pytest.raises(RewardError, match=r"environment guess, episode 1: reset: no answer within"):
            first_messages([{"prompt": "x"}], [Guess(), Stuck()], 2, 0, "guess", timeout_s=0.5)
    finally:
        release.set()


def test_an_environment_that_raises_stops_the_rollout_naming_it(tokenizer):
    class Broken(Guess):
        def step(self, text, last_turn):
            raise KeyError("board")

    engine = ScriptedEngine(tokenizer, [["5"]])
    with pytest.raises(
        RewardError, match=r"environment guess, episode 0, turn 1: step: raised KeyError\('board'\)"
    ):
        play_episodes(engine, tokenizer, [[5]], SamplingParams(n=1), 0, [Broken()], 2, env_name="guess")


def test_an_environments_reward_replaces_the_scorers():
    from components.batch import Batch
    from components.rl import score_responses
    from components.settings import RewardSettings

    batch = Batch(
        {"env_reward": torch.tensor([1.0, float("nan")])},
        {"ground_truth": ["a", "b"], "data_source": ["s", "s"], "extra_info": [{}, {}]},
    )

    def score(texts, truths, sources, extras):
        return [0.25, 0.0], [True, False], {}  # the second invalid, counted as 0

    with pytest.raises(RewardError):  # the second row has neither: invalid, over the limit of 0
        score_responses(batch, ["x", "y"], score, RewardSettings((8, 0, 1.0), max_invalid_frac=0.0))
    scored = score_responses(batch, ["x", "y"], score, RewardSettings((8, 0, 1.0), max_invalid_frac=0.5))
    assert scored.scores[0] == 1.0 and scored.valid == [True, False]


def test_the_config_refuses_an_unknown_environment_listing_the_valid_ones():
    from components.config import load_config
    from components.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"multi_turn.env='chess': no such environment; valid: agent, single, textarena, tools",
    ):
        load_config("configs/arith_grpo.yaml", ["multi_turn.env=chess"])
    with pytest.raises(
        ConfigError, match=r"multi_turn.envs.game/\*='chess': no such environment; valid: agent, single"
    ):
        load_config("configs/arith_grpo.yaml", ["multi_turn.envs={game/*: chess}"])
    with pytest.raises(
        ConfigError, match=r"multi_turn.agent names the agent program of the agent environment"
    ):
        load_config("configs/arith_grpo.yaml", ["multi_turn.enable=true", "multi_turn.envs={game/*: agent}"])
    cfg = load_config("configs/arith_grpo.yaml", ["multi_turn.envs={reasoning_gym/*: single}"])
    assert cfg.multi_turn.envs == {"reasoning_gym/*": "single"}


def test_the_docs_environment_as_written():
    """docs/environments.md's example, run as written: it registers `guess`, whose episodes start with its
    own message and end with its reward."""
    from components.envs.base import ENVS
    from tests.docs.blocks import marked

    try:
        exec(marked("test_the_docs_environment_as_written").body, {})
        env = episode_factory("guess")()
        assert env.reset({"prompt": "x"}, 0) == [{"role": "user", "content": "guess 0-9"}]
        assert env.step("3", last_turn=False) == Step("higher", role="user")
        assert env.step("7", last_turn=False).reward == 1.0 and env.step("3", last_turn=True).reward == 0.0
    finally:
        ENVS.pop("guess", None)


def test_an_opening_past_the_context_is_refused_naming_the_episode(tokenizer):
    engine = ScriptedEngine(tokenizer, [["5"]])
    with pytest.raises(
        RewardError,
        match=r"environment guess, episode 0: its first messages are 10 tokens, and with "
        r"engine.max_new_tokens=4 they pass actor.model.max_seq_len=12",
    ):
        play_episodes(
            engine,
            tokenizer,
            [[5] * 10],
            SamplingParams(n=1, max_new_tokens=4),
            0,
            [Guess()],
            2,
            env_name="guess",
            max_context=12,
        )


def test_an_observation_past_the_context_ends_its_episode_and_is_counted(tokenizer, caplog):
    class Chatty(Guess):
        def step(self, text, last_turn):
            return Step("higher " * 20, role="user")  # far more than the context has room for

    engine = ScriptedEngine(tokenizer, [["5"], ["6"]])
    mt = play_episodes(
        engine,
        tokenizer,
        [[5]],
        SamplingParams(n=1, max_new_tokens=4),
        0,
        [Chatty()],
        3,
        env_name="guess",
        max_context=40,
    )
    assert mt.num_turns.tolist() == [1.0] and mt.counts["context_full"].tolist() == [1.0]
    assert mt.out.response_mask.sum() == mt.out.responses.ne(tokenizer.pad_token_id).sum()  # no observation
    (said,) = caplog.messages
    assert said.startswith("environment guess, episode 0, turn 1: its observation (") and "ends there" in said
