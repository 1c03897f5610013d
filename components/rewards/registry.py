"""Scorers keyed by `data_source`, and scoring of a whole batch with invalid values counted."""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

from components.rewards import gsm8k

Scorer = Callable[..., float]

REWARDS: dict[str, Callable[..., Scorer]] = {
    # data_source -> factory(reward_model config) -> scorer(response_text, ground_truth, extra_info)
    "arith": lambda rm: partial(gsm8k.score, method=rm.method, format_score=rm.format_score),
    "openai/gsm8k": lambda rm: partial(gsm8k.score, method=rm.method, format_score=rm.format_score),
}


def scorer_for(data_source: str, reward_cfg) -> Scorer:
    if data_source not in REWARDS:
        raise KeyError(f"data_source={data_source!r}: no reward scorer registered; known sources: "
                       f"{', '.join(sorted(REWARDS))}. Register one in components/rewards/registry.py.")
    return REWARDS[data_source](reward_cfg)


def scorers_for(data_sources: list[str], reward_cfg) -> dict[str, Scorer]:
    """The scorer of each distinct data_source (KeyError naming an unregistered one)."""
    return {source: scorer_for(source, reward_cfg) for source in dict.fromkeys(data_sources)}


def score_batch(texts: list[str], ground_truths: list[str], data_sources: list[str], extra_infos: list[dict],
                reward_cfg, scorers: dict[str, Scorer] | None = None) -> tuple[list[float], list[bool]]:
    """Scores per response and whether each is valid; invalid ones (None, NaN, inf, not a number) score 0.

    A scorer that raises is a bug: the error names the sample and is not retried. `scorers` (data_source ->
    scorer, from scorers_for) lets another process score with the scorers resolved here.
    """
    scores, valid = [], []
    cache = scorers if scorers is not None else scorers_for(data_sources, reward_cfg)
    for i, (text, truth, source, extra) in enumerate(zip(texts, ground_truths, data_sources, extra_infos)):
        fn = cache[source]
        try:
            value = fn(text, truth, extra)
        except Exception as exc:
            raise RuntimeError(f"reward scorer for data_source={source!r} failed on sample {i} "
                               f"(response {text[:80]!r}, ground truth {truth!r}): {exc!r}") from exc
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        scores.append(float(value) if ok else 0.0)
        valid.append(ok)
    return scores, valid
