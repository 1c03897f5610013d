"""TextArena's GuessTheNumber as an environment: the opening, the game's answers as user turns, the reward."""

from __future__ import annotations

import re

import pytest

from components.envs.base import episode_factory
from components.settings import MultiTurnSettings


def game():
    return episode_factory("textarena", MultiTurnSettings(10, (), 256, game="GuessTheNumber-v0"))()


def test_a_game_won_by_bisection_pays_1():
    env = game()
    (opening,) = env.reset({"prompt": "unused"}, seed=0)
    assert opening["role"] == "user" and "Guess The Number" in opening["content"]
    lo, hi, turns = 1, 20, 0
    while True:
        guess = (lo + hi) // 2
        step = env.step(f"[{guess}]", last_turn=False)
        turns += 1
        if step.ends:
            break
        assert step.role == "user" and "[Player]" not in step.observation  # the game's lines only
        lo, hi = (guess + 1, hi) if "higher" in step.observation else (lo, guess - 1)
    assert step.reward == 1.0 and step.counts == {"game_won": 1.0} and turns <= 5


def test_a_move_out_of_format_is_answered_and_a_game_out_of_turns_pays_0():
    env = game()
    env.reset({}, seed=1)
    step = env.step("seven", last_turn=False)
    assert not step.ends and re.search(r"invalid move", step.observation, re.I)
    last = env.step("[1]", last_turn=True)
    assert last.done and last.reward in (0.0, 1.0)  # 1 only if 1 was the number
    assert game().reset({}, seed=1) == game().reset({}, seed=1)  # the seed decides the game


def test_a_game_lost_with_a_share_of_textarenas_reward_is_not_a_win():
    """GuessTheNumber ends a game lost by repeating a guess with a partial reward (how close the guesses came,
    0.58 here): a loss, paid 0 and not counted as won."""
    env = game()
    env.reset({}, seed=1)  # the number is 5
    for guess in ("[1]", "[13]", "[111]"):
        assert not env.step(guess, last_turn=False).ends
    lost = env.step("[1]", last_turn=False)  # the second invalid move ends the game
    assert lost.done and lost.reward == 0.0 and lost.counts == {"game_won": 0.0}


def test_the_config_refuses_an_unknown_game_naming_the_closest():
    from components.config import load_config
    from components.errors import ConfigError

    game = ("multi_turn.enable=true", "multi_turn.env=textarena")
    with pytest.raises(
        ConfigError,
        match=r"multi_turn.game='GuessTheNumbr-v0': TextArena has no such game; the closest: GuessTheNumber-v0",
    ):
        load_config("configs/arith_grpo.yaml", [*game, "multi_turn.game=GuessTheNumbr-v0"])
    assert load_config("configs/arith_grpo.yaml", [*game]).multi_turn.game == "GuessTheNumber-v0"
