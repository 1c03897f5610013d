"""`single`: one assistant turn, scored by the row's data_source scorer: the plain rollout as an environment,
for the rows of a mixture (multi_turn.envs) that are not episodes of another."""

from __future__ import annotations

from components.envs.base import Step, register


class SingleTurn:
    def reset(self, row: dict, seed: int) -> None:
        return None  # the row's own prompt

    def step(self, text: str, last_turn: bool) -> Step:
        return Step()  # no observation: the episode ends, and no reward: the row's scorer scores the reply


@register("single")
def single_env(settings, tools: dict):
    """A one-turn episode per sample."""
    return SingleTurn
