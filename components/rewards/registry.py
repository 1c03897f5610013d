"""Reward scorers by name, the scorer of each `data_source`, and scoring of a whole batch.

A scorer is a plain function `(response_text, ground_truth, extra_info) -> float`, or a dict with `score` and
named sub-scores (numbers, logged as `reward/<name>/mean`). Which scorer a row gets, first match wins:
`custom_reward_function.path` (every row), `reward_model.sources[data_source]` (a name in SCORERS),
REWARDS[data_source] (the built-in default of a source), FAMILIES (a suite's sources by prefix:
`reasoning_gym/<task>`), `reward_model.default_scorer`; else a ConfigError.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from components.errors import ConfigError, RewardError
from components.rewards import countdown, gsm8k
from components.settings import SandboxLimits

if TYPE_CHECKING:
    from components.config.schema import Config

Scorer = Callable[..., "float | dict[str, float]"]


def _gsm8k(cfg: Config) -> Scorer:
    return partial(gsm8k.score, method=cfg.reward_model.method, format_score=cfg.reward_model.format_score)


def _math(cfg: Config) -> Scorer:
    from components.rewards import math_eq  # sympy and math-verify load only when a source needs them

    return partial(math_eq.score, format_score=cfg.reward_model.format_score)


def _countdown(cfg: Config) -> Scorer:
    return partial(countdown.score, format_score=cfg.reward_model.format_score or 0.1)


def _code(cfg: Config) -> Scorer:
    from components.rewards import code_exec
    from components.rewards.sandbox import bwrap_path

    bwrap_path()  # no bubblewrap: refuse here, before any rollout, rather than run code unconfined
    fn = partial(
        code_exec.score, limits=SandboxLimits.from_config(cfg.sandbox), concurrency=cfg.sandbox.concurrency
    )
    fn.concurrent = True  # waits on a subprocess: scored in parallel, up to sandbox.concurrency at once
    return fn


# scorer name -> factory(config) -> scorer; `reward_model.sources` and `default_scorer` name these.
SCORERS: dict[str, Callable[[Config], Scorer]] = {
    "gsm8k": _gsm8k,
    "math": _math,
    "countdown": _countdown,
    "code": _code,
}

# data_source -> factory(config) -> scorer: the built-in default of each known source.
REWARDS: dict[str, Callable[[Config], Scorer]] = {
    "arith": _gsm8k,
    "arith_tool": _gsm8k,
    "visual_count": _gsm8k,  # the visual counting task: `#### N`, as arith
    "openai/gsm8k": _gsm8k,
    "lighteval/MATH": _math,
    "DigitalLearningGmbH/MATH-lighteval": _math,
    "math": _math,
    "countdown": _countdown,
    "code": _code,
}


def _reasoning_gym(cfg: Config, data_source: str) -> Scorer:
    from components.data import reasoning_gym

    return partial(
        reasoning_gym.score, data_source=data_source, tasks=cfg.data.reasoning_gym, seed=cfg.trainer.seed
    )


# data_source prefix -> factory(config, data_source) -> scorer: families of sources, one per task of a suite
FAMILIES: dict[str, Callable[[Config, str], Scorer]] = {
    "reasoning_gym/": _reasoning_gym,
}


def scorer_for(data_source: str, cfg: Config) -> Scorer:
    rm = cfg.reward_model
    if cfg.custom_reward_function.path:
        from components.rewards.custom import load_custom_reward

        return load_custom_reward(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    if data_source in rm.sources:
        name = rm.sources[data_source]
        if name not in SCORERS:
            raise ConfigError(
                f"reward_model.sources.{data_source}={name!r}: no such scorer; known: "
                f"{', '.join(sorted(SCORERS))}. Fix the name or register the scorer in SCORERS."
            )
        return SCORERS[name](cfg)
    if data_source in REWARDS:
        return REWARDS[data_source](cfg)
    family = next((f for prefix, f in FAMILIES.items() if data_source.startswith(prefix)), None)
    if family is not None:
        return family(cfg, data_source)
    if rm.default_scorer is not None:
        return SCORERS[rm.default_scorer](cfg)
    raise ConfigError(
        f"data_source={data_source!r}: no reward scorer registered; known sources: "
        f"{', '.join(sorted(REWARDS))}. Map it with reward_model.sources.{data_source}=<scorer> "
        f"(scorers: {', '.join(sorted(SCORERS))}), set reward_model.default_scorer, or register "
        "it in components/rewards/registry.py."
    )


def _code_truth(truth, extra_info) -> str | None:
    from components.rewards import code_exec

    return code_exec.truth_problem(truth, extra_info)


# a scorer's own test of the ground truths it can ever match: the clean stage quarantines the others
TRUTH_CHECKS: dict[Callable, Callable[[object, dict | None], str | None]] = {
    _gsm8k: lambda truth, extra_info: gsm8k.truth_problem(truth),
    _code: _code_truth,
}


@dataclass(frozen=True)
class ScorerChoice:
    """Which scorer each data_source gets (reward_model.sources, reward_model.default_scorer, a custom reward
    function), as plain data a stage can hold and hash."""

    custom: bool = False
    sources: tuple[tuple[str, str], ...] = ()
    default: str | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> ScorerChoice:
        rm = cfg.reward_model
        return cls(
            bool(cfg.custom_reward_function.path), tuple(sorted(rm.sources.items())), rm.default_scorer
        )

    def factory(self, data_source: str) -> tuple[str, Callable] | None:
        """(the scorer's name, its factory) for `data_source`, as scorer_for picks it; None for a custom
        function or a source with no scorer (the run names that)."""
        if self.custom:
            return None
        name = dict(self.sources).get(data_source)
        if name in SCORERS:
            return name, SCORERS[name]
        if name is None and data_source in REWARDS:
            factory = REWARDS[data_source]
            return next((n for n, f in SCORERS.items() if f is factory), data_source), factory
        if name is None and self.default in SCORERS:
            return self.default, SCORERS[self.default]
        return None

    def truth_problem(self, data_source: str, truth, extra_info: dict | None = None) -> str | None:
        """Why `truth` can never be matched by the scorer `data_source` gets, naming it; None when it can, or
        when that scorer (a custom one, math's) takes any."""
        found = self.factory(data_source)
        check = TRUTH_CHECKS.get(found[1]) if found else None
        why = check(truth, extra_info) if check else None
        return f"the {found[0]} scorer can never match this ground truth: it {why}" if why else None


def scorers_for(data_sources: list[str], cfg: Config) -> dict[str, Scorer]:
    """The scorer of each distinct data_source (ConfigError naming an unregistered one and the mapping that
    fixes it)."""
    return {source: scorer_for(source, cfg) for source in dict.fromkeys(data_sources)}


def scorer_name(fn) -> str:
    """How an error names a scorer: the custom function's file, else its (partial's) function name."""
    origin = getattr(fn, "origin", None)
    if origin:
        return origin
    inner = getattr(fn, "func", fn)
    return f"{getattr(inner, '__module__', '')}.{getattr(inner, '__qualname__', repr(inner))}".lstrip(".")


def scorer_names(scorers: dict) -> str:
    """`data_source` -> scorer as one phrase: `arith: components.rewards.gsm8k.score`."""
    return ", ".join(f"{source}: {scorer_name(fn)}" for source, fn in scorers.items())


def _split(value, fn, i: int, source: str, text: str) -> tuple[object, dict[str, float]]:
    """A scorer's return value as (score, sub-scores). A score that is not a number, None, NaN or inf (a bool,
    a string, a list, a dict without a numeric `score`) is a RewardError naming the function, the sample and
    the type: training on it would learn nothing."""
    score, subs = value, {}
    if isinstance(value, dict):
        subs = {
            k: float(v)
            for k, v in value.items()
            if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        score = value.get("score")
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
        what = (
            "a dict without a numeric 'score'"
            if isinstance(value, dict)
            else f"{type(score).__name__} {repr(score)[:40]}"
        )
        raise RewardError(
            f"reward function {scorer_name(fn)} returned {what} for sample {i} (data_source "
            f"{source!r}, response {text[:60]!r}); a reward is an int or float (or a dict with a "
            "numeric 'score'), None or NaN for 'cannot score'. Return float(...)."
        )
    return score, subs


def score_with_config(
    texts: list[str],
    ground_truths: list[str],
    data_sources: list[str],
    extra_infos: list[dict],
    cfg: Config,
) -> tuple[list[float], list[bool], dict[str, list[float]]]:
    """score_batch with the scorers the config gives each data_source (for a one-off scoring in this process)."""
    return score_batch(
        texts,
        ground_truths,
        data_sources,
        extra_infos,
        scorers_for(data_sources, cfg),
        cfg.sandbox.concurrency,
    )


# the largest reward magnitude trained on: beyond it the group statistics and the float32 losses overflow (a reward
# of 1e308 is finite, but its group's mean is inf and every advantage NaN)
MAX_ABS_REWARD = 1e6


def usable_reward(value: float) -> bool:
    """A number training can use: finite and within ±MAX_ABS_REWARD (anything else is an invalid reward)."""
    return math.isfinite(value) and abs(value) <= MAX_ABS_REWARD


def score_batch(
    texts: list[str],
    ground_truths: list[str],
    data_sources: list[str],
    extra_infos: list[dict],
    scorers: dict[str, Scorer],
    concurrency: int = 2,
) -> tuple[list[float], list[bool], dict[str, list[float]]]:
    """Scores per response, whether each is valid, and the sub-scores (name -> per-row values, NaN where a
    row's scorer did not report that name). Invalid scores (None, NaN, inf) count as 0 and as invalid; a
    score of the wrong type (a bool, a string, a list) is a RewardError.

    A scorer that raises is a bug: the RewardError names the sample and is not retried. `scorers` (data_source ->
    scorer, from scorers_for, resolved in the driver) can be shipped to another process. Scorers marked
    `concurrent` (the sandboxed code scorer) run in threads, up to `concurrency` (sandbox.concurrency) at once.
    """
    cache = scorers

    def one(i: int):
        fn, source = cache[data_sources[i]], data_sources[i]
        try:
            value = fn(texts[i], ground_truths[i], extra_infos[i])
        except RewardError:  # already names the function and why (a custom module that exits at import)
            raise
        except Exception as exc:
            raise RewardError(
                f"reward scorer {scorer_name(fn)} for data_source={source!r} failed on sample {i} "
                f"(response {texts[i][:80]!r}, ground truth {ground_truths[i]!r}): {exc!r}"
            ) from exc
        return _split(value, fn, i, source, texts[i])

    parallel = [i for i, s in enumerate(data_sources) if getattr(cache[s], "concurrent", False)]
    results: dict[int, tuple] = {}
    if parallel:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            results.update(zip(parallel, pool.map(one, parallel)))
    for i in range(len(texts)):
        if i not in results:
            results[i] = one(i)
    scores, valid, subs = [], [], {}
    for i in range(len(texts)):
        value, sub = results[i]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and usable_reward(value)
        scores.append(float(value) if ok else 0.0)
        valid.append(ok)
        for name, v in sub.items():
            subs.setdefault(name, [math.nan] * len(texts))[i] = v
    return scores, valid, subs
