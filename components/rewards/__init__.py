"""Rewards: rule scorers keyed by `data_source`; each is `fn(response_text, ground_truth, extra_info) -> float`."""

from components.rewards.registry import REWARDS, score_batch

__all__ = ["REWARDS", "score_batch"]
