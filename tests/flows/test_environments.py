"""A TextArena game end to end on the tiny model, in a mixture: the rows of one data_source are games of several
turns, the game's reward their training reward, the others single-turn arithmetic scored by its scorer; only
the model's tokens are trained on, and each environment's figures are its own."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tests.flows.conftest import scores, sft_ready

pytestmark = pytest.mark.slow

GAME = (
    "multi_turn.enable=true",
    "multi_turn.env=single",
    "multi_turn.envs={game/*: textarena}",
    # a game row's reward is always the game's; the mapping is for a reply that ever needs its scorer
    "reward_model.sources={game/guess: gsm8k}",
    "multi_turn.game=GuessTheNumber-v0",
    "multi_turn.max_turns=3",
    "engine.max_new_tokens=6",
    "data.batch_size=4",
    # the game's opening is ~520 tokens of the character-level tokenizer; three turns and its answers follow
    "actor.model.max_seq_len=800",
)


def test_a_textarena_game_and_arithmetic_train_as_one_mixture_with_figures_of_their_own(
    tmp_path, prefect_harness
):
    import pandas as pd

    from flows.train import train_flow

    with sft_ready(tmp_path, iterations=2, extra=GAME) as ov:
        for split in ("train", "test"):  # every other row a game: a user's data of two sources
            path = tmp_path / "clean" / f"{split}.parquet"
            rows = pd.read_parquet(path)
            rows.loc[rows.index % 2 == 1, "data_source"] = "game/guess"
            rows.to_parquet(path)
        info = train_flow("configs/arith_grpo.yaml", ov)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    game_turns = scores(tmp_path, info["run_id"], "env/textarena/turns")
    single_turns = scores(tmp_path, info["run_id"], "env/single/turns")
    won = scores(tmp_path, info["run_id"], "env/textarena/game_won")
    assert len(game_turns) == 2 and all(t > 1.0 for t in game_turns)  # games of more than one turn
    assert single_turns == [1.0, 1.0]  # arithmetic: one reply
    assert len(won) == 2 and all(0.0 <= w <= 1.0 for w in won)  # every game's own outcome
    assert "env/single/game_won" not in client.get_run(info["run_id"]).data.metrics
    # held out: the games by their environment's reward, the arithmetic by its scorer
    final = client.get_run(info["run_id"]).data.metrics
    assert {"val/textarena/acc", "val/arith/acc"} <= set(final), sorted(final)
    assert client.get_run(info["run_id"]).info.status == "FINISHED"
