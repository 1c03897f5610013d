"""A TextArena game end to end on the tiny model: each sample is a game of several turns, the game's reward is
the training reward, and only the model's tokens are trained on."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tests.flows.conftest import scores, sft_ready

pytestmark = pytest.mark.slow

GAME = (
    "multi_turn.enable=true",
    "multi_turn.env=textarena",
    "multi_turn.game=GuessTheNumber-v0",
    "multi_turn.max_turns=3",
    "engine.max_new_tokens=6",
    "data.batch_size=2",
    # the game's opening is ~520 tokens of the character-level tokenizer; three turns and its answers follow
    "actor.model.max_seq_len=800",
)


def test_a_textarena_game_trains_with_its_own_reward(tmp_path, prefect_harness):
    from flows.train import train_flow

    with sft_ready(tmp_path, iterations=2, extra=GAME) as ov:
        info = train_flow("configs/arith_grpo.yaml", ov)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    turns = scores(tmp_path, info["run_id"], "num_turns/mean")
    env_reward = scores(tmp_path, info["run_id"], "reward/env/mean")
    assert len(turns) == 2 and all(t > 1.0 for t in turns)  # games of more than one turn
    assert len(env_reward) == 2 and all(0.0 <= r <= 1.0 for r in env_reward)  # every episode's own reward
    assert client.get_run(info["run_id"]).info.status == "FINISHED"
