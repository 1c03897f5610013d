"""Held-out evaluation: greedy accuracy and mean@k / pass@k per data_source (per environment for the episodes
an environment rewards).

One function for the training run's periodic test (the rollout group samples, the driver decodes, the
RewardScorer actor scores: the path training rewards take) and for evaluating a model directory in this
process (`reinforge evaluate`): only where generation and scoring run differs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from components.batch import Batch
from components.rl import episode_envs, with_env_rewards
from components.settings import SamplingParams

# (rows, params, seed) -> the rollout batch; batch -> texts; (texts, truths, sources, extras) -> scores
Generate = Callable[[list[dict], SamplingParams, int], Batch]
Decode = Callable[[Batch], list[str]]
Score = Callable[[list[str], list[str], list[str], list[dict]], tuple]


def accuracy_metrics(
    scores: list[float], sources: list[str], k: int, prefix: str = "val"
) -> dict[str, float]:
    """scores: row-major (prompt, sample) with k samples per prompt. acc = mean score; pass@k = any correct."""
    by_source: dict[str, list[list[float]]] = defaultdict(list)
    for i in range(0, len(scores), k):
        by_source[sources[i]].append(scores[i : i + k])
    out = {}
    for source, groups in by_source.items():
        name = source.replace("/", "_")
        out[f"{prefix}/{name}/acc_mean_at_{k}"] = sum(sum(g) / k for g in groups) / len(groups)
        out[f"{prefix}/{name}/pass_at_{k}"] = sum(max(g) >= 1.0 for g in groups) / len(groups)
    return out


def evaluate(
    generate: Generate,
    decode: Decode,
    score: Score,
    rows: list[dict],
    k: int,
    max_new_tokens: int,
    seed: int,
    temperature: float = 1.0,
    batch_size: int = 256,
    on_greedy: Callable[[list[dict], list[str], list[float]], None] | None = None,
) -> dict[str, float]:
    """Greedy accuracy (`val/<source>/acc`, `val/acc`) and sampled mean@k / pass@k on `rows`. `on_greedy`
    sees each chunk of rows with its greedy answers and their scores (the samples a run logs)."""
    results: dict[str, float] = {}
    for mode, params in (
        ("greedy", SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)),
        ("sampled", SamplingParams(n=k, temperature=temperature, max_new_tokens=max_new_tokens)),
    ):
        scores: list[float] = []
        sources: list[str] = []
        calls: list[float] = []
        for start in range(0, len(rows), batch_size):
            batch = generate(rows[start : start + batch_size], params, seed + start)
            nt = batch.non_tensors
            texts = decode(batch)
            s, _, _ = score(texts, nt["ground_truth"], nt["data_source"], nt["extra_info"])
            # an episode the environment rewarded counts as the environment's: val/<env>/acc
            env_scores, given, _ = with_env_rewards(torch.tensor(s, dtype=torch.float32), batch)
            s = env_scores.tolist()
            envs = episode_envs(batch)
            src = [e if g else d for g, e, d in zip(given.tolist(), envs, nt["data_source"])]
            if mode == "greedy" and on_greedy is not None:
                on_greedy(rows[start : start + batch_size], texts, s)
            scores += s
            sources += src
            calls += batch.tensors["tool_calls"].tolist() if "tool_calls" in batch.tensors else []
        if mode == "greedy":
            by: dict[str, list[float]] = defaultdict(list)
            for s_, src in zip(scores, sources):
                by[src].append(s_)
            for src, vals in by.items():
                results[f"val/{src.replace('/', '_')}/acc"] = sum(vals) / len(vals)
            results["val/acc"] = sum(scores) / len(scores)
            if calls:  # multi-turn: how often the greedy policy calls a tool
                results["val/tool_call_rate"] = sum(c > 0 for c in calls) / len(calls)
        else:
            results.update(accuracy_metrics(scores, sources, k))
    return results
