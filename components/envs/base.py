"""One interface for every episode the rollout plays, single- or multi-turn.

An environment is made per episode (one sample of one row). `reset(row, seed)` gives the first messages (None:
the row's own prompt); then, after each assistant turn, `step(text, last_turn)` gives a Step: the next
observation (a message of `role`: a tool's output, or the user's next move in a game) or none, a reward once
the episode is done (None: the row's data_source scorer scores the response), and counters summed over the
episode (`tool_calls`, `tool_errors`, ...). The rollout appends each observation through the chat template,
masked out of every loss: only the model's tokens are trained on.

Environments are chosen by name (`multi_turn.env`) from ENVS; each name maps to a factory of the run's
typed settings (MultiTurnSettings) and its tools that returns a new environment per episode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from components.errors import RewardError


@dataclass(frozen=True)
class Step:
    """What an environment answers an assistant turn with. observation None (or done) ends the episode."""

    observation: str | None = None
    reward: float | None = None
    done: bool = False
    role: str = "tool"
    counts: dict[str, float] = field(default_factory=dict)

    @property
    def ends(self) -> bool:
        return self.done or self.observation is None


class Environment(Protocol):
    def reset(self, row: dict, seed: int) -> list[dict] | None: ...

    def step(self, text: str, last_turn: bool) -> Step: ...


# env name -> factory(settings, tools) -> a new environment per episode
ENVS: dict[str, Callable[[Any, dict], Callable[[], Environment]]] = {}


def register(name: str):
    def put(factory):
        ENVS[name] = factory
        return factory

    return put


def episode_factory(name: str, settings: Any = None, tools: dict | None = None) -> Callable[[], Environment]:
    """The factory of environment `name` (ValueError naming multi_turn.env and the valid names)."""
    if name not in ENVS:
        raise ValueError(f"multi_turn.env={name!r}: no such environment; valid: {', '.join(sorted(ENVS))}")
    return ENVS[name](settings, tools or {})


def checked_reward(env: str, episode: int, reward: float | None) -> float | None:
    """An environment's reward, refused when it is not a finite number within the bound a scorer's reward is
    held to (usable_reward: ±MAX_ABS_REWARD); a RewardError naming the environment and the episode."""
    from components.rewards.registry import MAX_ABS_REWARD, usable_reward

    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise RewardError(f"environment {env}, episode {episode}: reward {reward!r} is not a finite number")
    if not usable_reward(reward):
        raise RewardError(
            f"environment {env}, episode {episode}: reward {reward!r} is out of range (±{MAX_ABS_REWARD:g})"
        )
    return float(reward)
