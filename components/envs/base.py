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

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from components.errors import RewardError

# a rollout batch's tensor of one episode counter (N,): env_count/<name>, e.g. env_count/game_won
ENV_COUNT = "env_count/"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """What an environment answers an assistant turn with. observation None (or done) ends the episode."""

    observation: str | list[dict] | None = None  # a message of `role`, or messages (an agent's new ones)
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
# env name -> the episode counters it declares: each is in every rollout batch that plays it (0 where an
# episode did not count it), and its figures are env/<env>/<counter>
COUNTERS: dict[str, tuple[str, ...]] = {}


def register(name: str, counters: tuple[str, ...] = ()):
    def put(factory):
        ENVS[name] = factory
        COUNTERS[name] = counters
        return factory

    return put


def episode_factory(name: str, settings: Any = None, tools: dict | None = None) -> Callable[[], Environment]:
    """The factory of environment `name` (ValueError naming multi_turn.env and the valid names)."""
    if name not in ENVS:
        raise ValueError(f"multi_turn.env={name!r}: no such environment; valid: {', '.join(sorted(ENVS))}")
    return ENVS[name](settings, tools or {})


INVALID = math.inf  # an episode's reward that was given but is unusable: counted by reward.max_invalid_frac


def checked_reward(env: str, episode: int, reward: float | None) -> float | None:
    """An environment's reward as the rollout keeps it: None (none given: the row's scorer scores the episode),
    the reward, or INVALID for one that is not a finite number within the bound a scorer's reward is held to
    (usable_reward: ±MAX_ABS_REWARD), said in one warning line naming the environment and the episode. Invalid
    rewards are counted against reward.max_invalid_frac, as a scorer's are."""
    from components.rewards.registry import MAX_ABS_REWARD, usable_reward

    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        why = "is not a finite number"
    elif not usable_reward(reward):
        why = f"is out of range (±{MAX_ABS_REWARD:g})"
    else:
        return float(reward)
    log.warning("environment %s, episode %d: reward %r %s; counted invalid", env, episode, reward, why)
    return INVALID


def bounded(call: Callable[..., Any], args: tuple, timeout_s: float, where: str) -> Any:
    """call(*args) in a thread of its own, waited on for timeout_s: an environment's reset or step that hangs is a
    RewardError naming `where` (the environment, episode and turn) instead of a rollout that never ends; one
    that raises is the same, with what it raised. A hung call's thread is left behind (a daemon: Python cannot
    stop it), so the run stops on the error rather than play on beside it."""
    import threading

    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which names it
            result["error"] = exc

    thread = threading.Thread(target=run, name=f"env {where}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardError(
            f"{where}: no answer within multi_turn.step_timeout_s={timeout_s:g} s; fix the environment (a "
            "blocking call, a game waiting for input) or raise the limit"
        )
    if "error" in result:
        exc = result["error"]
        raise RewardError(f"{where}: raised {exc!r}") from exc
    return result["value"]
