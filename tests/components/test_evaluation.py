"""Held-out evaluation's figures by hand: greedy accuracy per data_source, and the episodes an environment
rewarded counted under the environment's name."""

from __future__ import annotations

import math

import torch

from components.batch import Batch
from components.evaluation import evaluate


def fake_generate(env_rewards: list[float]):
    """A rollout of the rows: one response per row and sample, the environment's reward per episode (NaN: the
    row's scorer scores it)."""

    def generate(rows, params, seed):
        n = params.n
        return Batch(
            {"env_reward": torch.tensor([r for r in env_rewards[: len(rows)] for _ in range(n)])},
            {
                "ground_truth": [r["truth"] for r in rows for _ in range(n)],
                "data_source": [r["source"] for r in rows for _ in range(n)],
                "extra_info": [{} for _ in rows for _ in range(n)],
                "env": ["textarena" for _ in rows for _ in range(n)],
            },
        )

    return generate


def test_episodes_an_environment_rewards_count_under_its_name():
    rows = [
        {"truth": "1", "source": "arith"},  # the scorer's: 1.0
        {"truth": "0", "source": "arith"},  # the scorer's: 0.0
        {"truth": "0", "source": "arith"},  # the game's: 1.0 (the scorer would say 0)
        {"truth": "1", "source": "arith"},  # the game's: 0.0 (the scorer would say 1)
    ]

    def score(texts, truths, sources, extras):
        return [float(t) for t in truths], [True] * len(truths), {}

    m = evaluate(
        fake_generate([math.nan, math.nan, 1.0, 0.0]),
        lambda batch: [""] * len(batch.non_tensors["ground_truth"]),
        score,
        rows,
        k=2,
        max_new_tokens=4,
        seed=0,
    )
    assert m["val/arith/acc"] == 0.5 and m["val/textarena/acc"] == 0.5 and m["val/acc"] == 0.5
    assert m["val/textarena/pass_at_2"] == 0.5 and m["val/arith/acc_mean_at_2"] == 0.5
