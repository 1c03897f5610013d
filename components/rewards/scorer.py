"""The reward functions' own process: the RewardScorer actor's body (components/training/ray_workers.py's
RewardGroup starts and calls it)."""

from __future__ import annotations

import os


class RewardScorer:
    """Scores rewards in a process of its own (a Ray actor), so a scorer that hangs can be killed with its
    whole process tree and one that kills its process is retried on a restarted actor."""

    def pid(self) -> int:
        return os.getpid()

    def score(self, texts, truths, sources, extras, scorers: dict, concurrency: int):
        from components.rewards.registry import score_batch

        return score_batch(texts, truths, sources, extras, scorers, concurrency)
