"""The reward-model path: Bradley-Terry training on arithmetic pairs, batched scoring, and its errors."""

from __future__ import annotations

import pytest

from components.errors import ConfigError
from components.models.loading import load_tokenizer
from components.rewards.reward_model import RewardModelScorer, arith_preference_pairs, train_reward_model


def rows(n: int) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"{a}+{a + 1}="}],
            "reward_model": {"ground_truth": str(2 * a + 1)},
        }
        for a in range(n)
    ]


def test_pairs_put_the_right_answer_first(tiny_model_dir):
    pairs = arith_preference_pairs(rows(20), load_tokenizer(tiny_model_dir), seed=0, per_row=2)
    assert len(pairs) == 40 and pairs[6][0] == "3+4=" and pairs[6][1] == pairs[7][1] == "#### 7"
    assert all(chosen != rejected for _, chosen, rejected in pairs)
    assert len({rejected for _, _, rejected in pairs[6:8]}) == 2  # two different kinds of wrong answer


def test_training_separates_chosen_from_rejected(tiny_model_dir, tmp_path):
    pairs = arith_preference_pairs(rows(40), load_tokenizer(tiny_model_dir), seed=0, per_row=1)
    out = train_reward_model(
        str(tiny_model_dir), pairs, tmp_path / "rm", steps=40, batch_size=32, lr=3e-3, seed=0
    )
    assert out["pair_accuracy"] > 0.75 and out["loss"] < 0.6
    scorer = RewardModelScorer(str(tmp_path / "rm"), batch_size=7)  # several batches, ragged last one
    prompts = [p for p, _, _ in pairs]
    chosen = scorer.score(prompts, [c for _, c, _ in pairs])
    rejected = scorer.score(prompts, [r for _, _, r in pairs])
    assert len(chosen) == 40 and sum(c > r for c, r in zip(chosen, rejected)) / 40 == out["pair_accuracy"]
    # batching and padding do not change a score
    assert scorer.score(prompts[:1], [pairs[0][1]])[0] == pytest.approx(chosen[0], abs=1e-5)


def test_a_causal_lm_or_a_missing_directory_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="reward_model.path=.*num_labels=1"):
        RewardModelScorer(str(tiny_model_dir))  # a causal LM loads as a 2-label classifier
    with pytest.raises(ConfigError, match="reward_model.path=.*config.json missing"):
        RewardModelScorer(str(tmp_path / "nothing"))
