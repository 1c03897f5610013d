"""A TextArena game's rows (data.task=textarena): the demonstrator's moves, held-out games named by their seed,
and SFT on a conversation trained on exactly the tokens the rollout holds at that turn."""

from __future__ import annotations

import re

import pytest

from components.data import games
from components.envs.base import episode_factory
from components.settings import MultiTurnSettings, PromptSettings, SamplingParams

GAME = "GuessTheNumber-v0"


def a_game():
    return episode_factory("textarena", MultiTurnSettings(5, (), 64, game=GAME))()


def test_the_demonstrators_moves_keep_to_the_hints_and_each_is_a_row_of_the_conversation_before_it():
    train, test = games.rows(GAME, 40, 5, max_turns=5, seed=0)
    assert len(train) == 40 and all(r["data_source"] == "textarena/GuessTheNumber-v0" for r in train + test)
    for row in train:
        prompt, move = row["prompt"], row["extra_info"]["answer"]
        assert prompt[0]["role"] == "user" and "Guess The Number" in prompt[0]["content"]
        assert [m["role"] for m in prompt] == ["user"] + ["assistant", "user"] * (len(prompt) // 2)
        low, high = 1, 20  # every move is a number the hints so far still allow
        for guess, hint in zip(prompt[1::2], prompt[2::2]):
            k = int(guess["content"].strip("[]"))
            low, high = (k + 1, high) if "higher" in hint["content"] else (low, k - 1)
        assert re.fullmatch(r"\[\d+\]", move) and low <= int(move.strip("[]")) <= high
    # held-out rows: one game each, its opening, named by a seed no training game has
    seeds = {r["extra_info"]["env_seed"] for r in train}
    assert all(len(r["prompt"]) == 1 and r["extra_info"]["env_seed"] not in seeds for r in test)
    assert len({r["extra_info"]["env_seed"] for r in test}) == 5


def test_a_rows_game_is_replayed_from_its_seed_and_its_truth_is_the_number():
    _, test = games.rows(GAME, 1, 3, max_turns=5, seed=0)
    for row in test:
        env = a_game()
        assert env.reset(row, seed=123) == env.reset(row, seed=456) == row["prompt"]  # the row's game
        won = env.step(f"[{row['reward_model']['ground_truth']}]", last_turn=False)
        assert won.done and won.reward == 1.0


def test_sft_on_a_conversation_trains_on_the_tokens_the_rollout_holds_at_that_turn():
    """The tiny model's template renders no end of an assistant turn, and the rollout keeps the EOS each reply
    ended with: a game's conversation encoded for SFT is the rollout's context token for token."""
    from components.models import build_char_tokenizer
    from components.rollout.multi_turn import play_episodes
    from components.training.sft import encode_examples
    from tests.components.rollout.test_multi_turn import ScriptedEngine

    tokenizer = build_char_tokenizer()
    train, _ = games.rows(GAME, 12, 1, max_turns=5, seed=0)
    row = max(train, key=lambda r: len(r["prompt"]))  # a later turn: a conversation of several moves
    moves = [m["content"] for m in row["prompt"][1::2]]
    assert len(moves) >= 2
    settings = PromptSettings()
    opening = encode_examples(tokenizer, [row["prompt"][:1]], ["x"], settings)[0].prompt_ids
    env = a_game()
    env.reset(row, seed=0)  # the row's game: the same answers to the same moves
    engine = ScriptedEngine(tokenizer, [[move] for move in moves] + [["[1]"]])
    play_episodes(
        engine, tokenizer, [opening], SamplingParams(n=1), 0, [env], len(moves) + 1, 64, "textarena"
    )
    answer = row["extra_info"]["answer"]
    (example,) = encode_examples(tokenizer, [row["prompt"]], [answer], settings, None, None, 64)
    assert example.prompt_ids == engine.seen[len(moves)][0]  # the context of the turn the row's move is in
    eos = tokenizer.eos_token_id
    assert example.answer_ids == tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
    assert example.prompt_ids.count(eos) == len(moves)  # each earlier reply's EOS, as the rollout keeps it


def test_a_game_without_a_demonstrator_or_without_the_game_environment_is_the_configs_error():
    from components.errors import ConfigError
    from components.validate import load_checked

    with pytest.raises(
        ConfigError, match=r"multi_turn.game='Wordle-v0' has no demonstrator.*GuessTheNumber-v0"
    ):
        load_checked("configs/game_grpo.yaml", ["multi_turn.game=Wordle-v0"])
    with pytest.raises(
        ConfigError, match="data.task=textarena makes rows of a game.*multi_turn.env=textarena"
    ):
        load_checked("configs/game_grpo.yaml", ["multi_turn.env=tools"])
