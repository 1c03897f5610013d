"""A TextArena game's rows (data.task=textarena): held-out games and the SFT warm start's demonstrations, made
by playing the real game (multi_turn.game) locally from the seed; nothing is downloaded.

A demonstrator plays each training game with a legal, unskilled strategy, and every turn it plays is one row:
the conversation so far as the prompt, its move as the answer. SFT on them teaches the game's format and its
rules, not how to win; GRPO then plays the game itself (multi_turn.env=textarena) for the game's outcome.
Every row names its game's seed (extra_info.env_seed): the environment replays that game, so a held-out row is
one fixed game, told apart from the others by its seed, not its opening (all openings are alike).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

SOURCE_PREFIX = "textarena/"
# training and held-out games are drawn from seeds of their own
SPLIT_SEEDS = {"train": 0, "test": 1_000_003}

# a move given the game's lines so far -> the next move
Player = Callable[[list[str]], str]


def guess_within_hints(rng: random.Random | None, low: int = 1, high: int = 20) -> Player:
    """GuessTheNumber's demonstrator: a number drawn at random among those the hints so far still allow. It
    always plays a legal, useful move and wins by luck (about 1 game in 3 within 3 turns). With no `rng` it
    plays the middle one (bisection), which wins every game: how a row's number is found."""
    bounds = [low, high]
    last: list[int] = []

    def move(lines: list[str]) -> str:
        if last and lines:
            said = lines[-1]
            if "higher" in said:
                bounds[0] = last[-1] + 1
            elif "lower" in said:
                bounds[1] = last[-1] - 1
        last.append(rng.randint(*bounds) if rng is not None else sum(bounds) // 2)
        return f"[{last[-1]}]"

    return move


# the game (TextArena env id) -> its demonstrator, made per game from a seeded RNG (None: its best play)
DEMONSTRATORS: dict[str, Callable[[random.Random | None], Player]] = {"GuessTheNumber-v0": guess_within_hints}


def check_game(game: str) -> None:
    """ValueError naming multi_turn.game when data.task=textarena has no demonstrator for it."""
    if game not in DEMONSTRATORS:
        raise ValueError(
            f"data.task=textarena: multi_turn.game={game!r} has no demonstrator to make its SFT rows; games "
            f"with one: {', '.join(sorted(DEMONSTRATORS))}"
        )


def play(game: str, seed: int, player: Player, max_turns: int | None) -> tuple[list[dict], int, bool]:
    """One game of `game` played by `player` through the environment the rollout plays (TextArenaGame): the
    conversation (the opening, then each move and the game's answer), the turns played, and whether it was
    won. max_turns None plays to the game's own end."""
    from components.envs.textarena import TextArenaGame

    env = TextArenaGame(game)
    messages = env.reset({}, seed)
    said = [messages[0]["content"]]
    turn = 0
    while max_turns is None or turn < max_turns:
        move = player(said)
        turn += 1
        step = env.step(move, last_turn=max_turns is not None and turn == max_turns)
        messages.append({"role": "assistant", "content": move})
        if step.ends:
            return messages, turn, bool(step.reward)
        messages.append({"role": step.role, "content": step.observation})
        said.append(step.observation)
    return messages, turn, False


def rows(game: str, num_train: int, num_eval: int, max_turns: int, seed: int) -> tuple[list, list]:
    """num_train demonstration rows (one per move, games played until there are enough) and num_eval
    held-out games (their openings). A row's ground truth is its game's number, found by playing the game to
    its end: the fallback scorer's truth for an episode the game leaves unrewarded."""
    from components.data.formats import make_row
    from components.envs.textarena import TextArenaGame

    @functools.cache  # a game's moves are rows of their own: play it to its end once
    def number(game_seed: int) -> str:
        messages, _, won = play(game, game_seed, DEMONSTRATORS[game](None), None)
        return messages[-1]["content"].strip("[]") if won else ""  # the winning move

    def row(split: str, index: int, prompt: list[dict], answer: str, game_seed: int) -> dict:
        out = make_row(SOURCE_PREFIX + game, prompt[-1]["content"], answer, number(game_seed), split, index)
        out["prompt"] = prompt
        out["ability"] = "game"
        out["extra_info"]["env_seed"] = game_seed
        return out

    train: list[dict] = []
    rng = random.Random(seed + SPLIT_SEEDS["train"])
    game_seed = seed + SPLIT_SEEDS["train"]
    while len(train) < num_train:
        messages, _, _ = play(game, game_seed, DEMONSTRATORS[game](rng), max_turns)
        for k, message in enumerate(messages):
            if message["role"] == "assistant" and len(train) < num_train:
                train.append(row("train", len(train), messages[:k], message["content"], game_seed))
        game_seed += 1
    test = []
    for i in range(num_eval):
        game_seed = seed + SPLIT_SEEDS["test"] + i
        test.append(row("test", i, TextArenaGame(game).reset({}, game_seed), "", game_seed))
    return train, test
