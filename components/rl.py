"""The RL iteration's pure stages over Batch: build the rollout batch, score it, compute advantages.

Workers and orchestration call these; none of them touches Ray, Prefect or MLflow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from components.algorithms.advantages import ADVANTAGES, AdvantageParams
from components.algorithms.losses import explained_variance
from components.algorithms.rollout_correction import correct_advantages
from components.algorithms.shaping import informative_groups, kl_in_reward, overlong_penalty
from components.batch import Batch
from components.envs.base import ENV_COUNT
from components.errors import RewardError
from components.settings import DistillSettings

if TYPE_CHECKING:
    from components.algorithms.presets import ResolvedAlgorithm
    from components.settings import RewardSettings


def _stats(name: str, x: torch.Tensor) -> dict[str, float]:
    """{name}/mean, /max, /min of a 1-D tensor (0 when empty)."""
    if not x.numel():
        return {f"{name}/mean": 0.0, f"{name}/max": 0.0, f"{name}/min": 0.0}
    return {f"{name}/mean": float(x.mean()), f"{name}/max": float(x.max()), f"{name}/min": float(x.min())}


Score = Callable[[list[str], list[str], list[str], list[dict]], tuple[list[float], list[bool], dict]]


@dataclass
class Scored:
    """A rollout's scores: `scores` (N,) the reward before shaping (invalid rows 0), `valid` per row, and the
    reward/* metrics of the scoring."""

    scores: torch.Tensor
    valid: list[bool]
    metrics: dict[str, float]


def with_env_rewards(scores: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores (N,) with each episode's environment reward in place of its scorer's where the environment gave
    one (batch's env_reward: NaN where it gave none, INFINITE where it gave an unusable one, scored 0), the
    (N,) bool mask of the rows the environment rewarded, and the (N,) mask of those whose reward is invalid."""
    none = torch.zeros(len(scores), dtype=torch.bool)
    if "env_reward" not in batch.tensors:
        return scores, none, none
    env = batch.tensors["env_reward"]
    given, invalid = ~torch.isnan(env), torch.isinf(env)
    return torch.where(given, torch.where(invalid, 0.0, env), scores), given, invalid


def score_responses(
    batch: Batch,
    texts: list[str],
    score: Score,
    settings: RewardSettings,
    model_scores: list[float] | None = None,
) -> Scored:
    """Each response scored by its row's scorer (`score(texts, truths, sources, extras)` -> (scores, valid,
    sub-scores): the RewardGroup's actor in a run), mixed with a reward model's scores when given:
    score = rule_weight x rule score + model_weight x model score. A row whose score (or model score) is not
    a usable number is invalid; more of them than settings.max_invalid_frac is a RewardError. Scorers' named
    sub-scores are logged as reward/<name>/mean."""
    nt = batch.non_tensors
    scores, valid, subs = score(texts, nt["ground_truth"], nt["data_source"], nt["extra_info"])
    s = torch.tensor(scores, dtype=torch.float32)
    metrics = {f"reward/{name}/mean": float(torch.tensor(v).nanmean()) for name, v in subs.items()}
    s, given, invalid = with_env_rewards(s, batch)
    valid = [(g and not bad) or (ok and not g) for ok, g, bad in zip(valid, given.tolist(), invalid.tolist())]
    if (given & ~invalid).any():
        metrics["reward/env/mean"] = float(s[given & ~invalid].mean())
    if model_scores is not None:
        from components.rewards.registry import usable_reward

        # a reward model's score that is not a usable number makes its row invalid, as a scorer's does
        valid = [ok and usable_reward(m) for ok, m in zip(valid, model_scores)]
        learned = torch.tensor([m if usable_reward(m) else 0.0 for m in model_scores], dtype=torch.float32)
        metrics.update({**_stats("reward/rule_score", s), **_stats("reward/model_score", learned)})
        s = settings.rule_weight * s + settings.model_weight * learned
    invalid = len(valid) - sum(valid)
    limit = settings.max_invalid_frac
    if invalid > limit * len(valid):
        sources = sorted({src for src, ok in zip(nt["data_source"], valid) if not ok})
        raise RewardError(
            f"iteration {batch.meta.get('iteration')}: {invalid} of {len(valid)} rewards are invalid "
            f"(None, NaN or inf; data_source "
            f"{', '.join(map(repr, sources))}), more than reward.max_invalid_frac={limit}: training on "
            "them would learn nothing. Fix the reward function (custom_reward_function or the "
            "data_source's scorer), or raise reward.max_invalid_frac."
        )
    metrics.update({**_stats("critic/score", s), "reward/invalid_count": float(invalid)})
    return Scored(s, list(valid), metrics)


def score_baseline(batch: Batch, baseline_texts: list[str], score: Score) -> torch.Tensor:
    """remax: the greedy completion of each prompt (repeated over its n samples in `baseline_texts`), scored
    once per prompt; (N,), each row its prompt's baseline score."""
    nt, n = batch.non_tensors, batch.meta.get("n", 1)
    per_prompt, _, _ = score(
        baseline_texts[::n], nt["ground_truth"][::n], nt["data_source"][::n], nt["extra_info"][::n]
    )
    return torch.tensor(per_prompt, dtype=torch.float32).repeat_interleave(n)


def place_rewards(
    batch: Batch, scored: Scored, settings: RewardSettings, baseline: torch.Tensor | None = None
) -> tuple[Batch, dict[str, float]]:
    """The sequence reward on each response's last model token (token_rewards (N, R); tool turns may follow
    it): the score plus DAPO's overlong penalty when settings.overlong's buffer is > 0. A remax `baseline`
    (N,) becomes baseline_values (N, R)."""
    mask = batch.tensors["response_mask"]
    rewards, metrics, extra = scored.scores, {}, {}
    if settings.overlong[1] > 0:
        penalty = overlong_penalty(mask.sum(-1), *settings.overlong)
        rewards = scored.scores + penalty
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
    if baseline is not None:
        extra["baseline_values"] = baseline[:, None] * mask
        metrics["reward/greedy_baseline_mean"] = float(baseline.mean())
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32)
    last = (torch.arange(1, mask.shape[1] + 1) * mask).argmax(-1)
    token_rewards[torch.arange(len(rewards)), last] = rewards
    metrics.update(_stats("critic/rewards", rewards))
    placed = batch.union(
        token_rewards=token_rewards, scores=scored.scores, valid=torch.tensor(scored.valid), **extra
    )
    return placed, metrics


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """What a rollout looked like: response and prompt lengths, engines restarted on the way, and a
    multi-turn rollout's turns and tool calls."""
    t = batch.tensors
    metrics = {
        **_stats("response_length", t["response_mask"].sum(-1).float()),
        "prompt_length/mean": float(t["prompt_mask"].sum(-1).float().mean()),
    }
    if "engine_restarts" in batch.meta:  # engines restarted during this rollout (health checks, deaths)
        metrics["rollout/engine_restarts"] = float(batch.meta["engine_restarts"])
    if "num_turns" in t:  # multi-turn rollouts
        metrics.update(
            {
                "num_turns/mean": float(t["num_turns"].mean()),
                "num_turns/max": float(t["num_turns"].max()),
                "tool_call_counts/mean": float(t["tool_calls"].mean()),
                "tool_call_rate": float((t["tool_calls"] > 0).float().mean()),
                "tool_errors/mean": float(t["tool_errors"].mean()),
                **env_metrics(batch),
            }
        )
    return metrics


def episode_envs(batch: Batch) -> list[str]:
    """Each sample's environment (the rollout worker's `env`); `env` for all of a batch without one."""
    return batch.non_tensors.get("env") or ["env"] * len(batch)


def env_metrics(batch: Batch) -> dict[str, float]:
    """A multi-turn rollout's figures under each environment's name (episode_envs): env/<env>/turns,
    env/<env>/reward (the mean over the episodes it rewarded) and env/<env>/<counter> over its episodes, for
    the counters it declares (meta env_counters) and any no played environment declares (`context_full`)."""
    t, names = batch.tensors, episode_envs(batch)
    declared = batch.meta.get("env_counters", {})
    owned = {c for counters in declared.values() for c in counters}
    out = {}
    for env in dict.fromkeys(names):
        mine = torch.tensor([name == env for name in names])
        out[f"env/{env}/turns"] = float(t["num_turns"][mine].float().mean())
        if "env_reward" in t:
            reward = t["env_reward"][mine]
            if torch.isfinite(reward).any():
                out[f"env/{env}/reward"] = float(reward[torch.isfinite(reward)].mean())
        for key, values in t.items():
            counter = key.removeprefix(ENV_COUNT)
            if key.startswith(ENV_COUNT) and (counter in declared.get(env, ()) or counter not in owned):
                out[f"env/{env}/{counter}"] = float(values[mine].float().mean())
    return out


def distill_advantages(
    task_adv: torch.Tensor, old: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, d: DistillSettings
) -> tuple[torch.Tensor, dict[str, float]]:
    """On-policy distillation's advantages (N, R): coef x (log p_teacher - log p_student) on each sampled
    token, the negative of the per-token reverse KL estimate, plus task_coef x the task's advantages; and
    `distill/reverse_kl` (token mean of log p_student - log p_teacher) and `distill/teacher_logprob`.

    >>> adv, m = distill_advantages(torch.tensor([[2.0, 2.0]]), torch.tensor([[-1.0, -3.0]]),
    ...                             torch.tensor([[-0.5, -1.0]]), torch.ones(1, 2), DistillSettings(1.0, 0.5))
    >>> adv.tolist(), m["distill/reverse_kl"]
    ([[1.5, 3.0]], -1.25)
    """
    gap = (teacher - old) * mask
    on = mask.bool()
    metrics = {
        "distill/reverse_kl": float(-gap[on].mean()) if on.any() else 0.0,
        "distill/teacher_logprob": float(teacher[on].mean()) if on.any() else 0.0,
    }
    return d.coef * gap + d.task_coef * task_adv, metrics


def add_advantages(
    batch: Batch,
    algo: ResolvedAlgorithm,
    kl_coef: float | None = None,
    kl_kind: str = "k1",
    distill: DistillSettings | None = None,
) -> tuple[Batch, dict[str, float]]:
    """Advantages and returns by the resolved algorithm's estimator (with a teacher, `distill`, those of
    on-policy distillation: distill_advantages).

    kl_coef (use_kl_in_reward) subtracts kl_coef x KL(old, ref) from the token rewards first; the measured
    KL is returned as `actor/reward_kl_penalty` for the adaptive controller. Rows with an invalid reward get
    zero advantage, sit in groups of their own (outside everyone else's baseline) and are masked out of
    response_mask, so they never reach a loss.
    """
    t = batch.tensors
    valid = t["valid"].bool() if "valid" in t else torch.ones(len(batch), dtype=torch.bool)
    mask = t["response_mask"].float() * valid[:, None]
    alone = -torch.arange(1, len(batch) + 1)  # negative ids never clash with the rollout's 0..B-1
    group_ids = torch.where(valid, t["group_ids"], alone)
    token_rewards, metrics = t["token_rewards"], {}
    if kl_coef is not None:
        token_rewards, kl = kl_in_reward(
            token_rewards, t["old_logprobs"], t["ref_logprobs"], mask, kl_coef, kl_kind
        )
        metrics.update({"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": kl_coef})
    values = t["values"] if "values" in t else t.get("baseline_values")
    params = AdvantageParams(norm_adv_by_std=algo.norm_adv_by_std, gamma=algo.gamma, lam=algo.lam)
    adv, returns = ADVANTAGES.get(algo.adv_estimator)(token_rewards, mask, group_ids, values, params)
    on = mask.bool()
    if distill is not None:  # the teacher's log-probs (prepare) against the student's that sampled
        adv, distilled = distill_advantages(adv, t["old_logprobs"], t["teacher_logprobs"], mask, distill)
        metrics.update(distilled)
    metrics.update({**_stats("critic/advantages", adv[on]), **_stats("critic/returns", returns[on])})
    if algo.rollout_correction != "none":  # the engine sampled; the trainer's old log-probs are the target
        adv, corr = correct_advantages(
            adv,
            t["old_logprobs"],
            t["rollout_logprobs"],
            mask,
            algo.rollout_correction,
            algo.rollout_correction_params,
        )
        metrics.update(corr)
    if "values" in t:
        metrics.update(
            {
                **_stats("critic/values", t["values"][on]),
                "critic/vf_explained_var": explained_variance(t["values"], returns, mask),
            }
        )
    return batch.union(advantages=adv, returns=returns, response_mask=mask.long()), metrics


def informative_rows(batch: Batch) -> Batch:
    """DAPO's dynamic sampling: only the rows of groups whose scores are not all equal."""
    keep = informative_groups(batch.tensors["scores"], batch.tensors["group_ids"])
    return batch.select(keep.nonzero().squeeze(-1))


def first_groups(batch: Batch, n_groups: int) -> Batch:
    """The rows of the first `n_groups` distinct groups, in order."""
    ids = batch.tensors["group_ids"]
    keep_ids = list(dict.fromkeys(ids.tolist()))[:n_groups]
    return batch.select(torch.isin(ids, torch.tensor(keep_ids, dtype=ids.dtype)).nonzero().squeeze(-1))


ZERO_REWARD_ITERATIONS = 3  # iterations whose every reward is exactly 0 before a run says so


def zero_reward_warning(history: list[dict], scorers: str) -> str | None:
    """One line when the run's first ZERO_REWARD_ITERATIONS iterations (`history`: their metrics) rewarded
    every sample exactly 0, naming the likely causes and the `scorers` used; None otherwise (and after)."""
    if len(history) != ZERO_REWARD_ITERATIONS:
        return None
    if any(h.get("critic/score/max") != 0.0 or h.get("critic/score/min") != 0.0 for h in history):
        return None
    first, last = history[0].get("step", 1), history[-1].get("step", ZERO_REWARD_ITERATIONS)
    return (
        f"iterations {first}-{last}: every sample's reward was exactly 0 (scored by {scorers}), so nothing is "
        "learned: the ground truths may be ones the scorer never matches (`reinforge clean` quarantines those it "
        "knows), the answers may lack the form it extracts (gsm8k's strict method wants `#### N`), or the model "
        "needs a warm start (SFT)"
    )
