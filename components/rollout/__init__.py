"""Rollout engines behind one interface (token ids in, token ids + log-probs out), chosen by `engine.type`."""

from components.rollout.base import RolloutEngine, RolloutOutput, SamplingParams, make_engine

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "make_engine"]
