"""The pure RL stages: rewards (invalid scores, overlong penalty, greedy baseline), advantages (invalid rows
masked out, KL in the reward), and dynamic sampling's batch helpers."""

import math

import pytest
import torch

from components.algorithms.presets import resolve
from components.batch import Batch
from components.config.schema import AlgorithmConfig
from components.rewards.registry import REWARDS, score_with_config
from components.rl import (
    add_advantages,
    first_groups,
    informative_rows,
    place_rewards,
    score_baseline,
    score_responses,
)
from components.rollout.batching import concat_rounds
from components.settings import RewardSettings
from components.validate import load_checked

REWARD_CFG = load_checked(None)
SETTINGS = RewardSettings(overlong=(16, 0, 1.0))  # no overlong penalty; at most half the rewards invalid
ACCEPT_ALL = RewardSettings(overlong=(16, 0, 1.0), max_invalid_frac=1.0)


def local(texts, truths, sources, extras):
    """Scoring in this process, with the default config's scorers."""
    return score_with_config(texts, truths, sources, extras, REWARD_CFG)


def add_rewards(batch, texts, settings, score, baseline_texts=None, model_scores=None):
    """The reward stage after decoding (tasks/rl.py score_rewards): score, then place."""
    scored = score_responses(batch, texts, score, settings, model_scores)
    baseline = score_baseline(batch, baseline_texts, score) if baseline_texts is not None else None
    batch, placed = place_rewards(batch, scored, settings, baseline)
    return batch, {**scored.metrics, **placed}


@pytest.fixture
def nan_scorer():
    # a scorer that returns NaN for "nan", None for "none", inf for "inf", else 1 if the text is the truth
    def score(text, truth, extra):
        return {"nan": float("nan"), "none": None, "inf": float("inf")}.get(text, float(text == truth))

    REWARDS["test/invalid"] = lambda rm: score
    yield
    del REWARDS["test/invalid"]


def rollout(n_prompts=2, n=3, lengths=None, source="test/invalid"):
    rows = n_prompts * n
    lengths = torch.tensor(lengths or [2] * rows)
    R = int(lengths.max())
    mask = (torch.arange(R)[None] < lengths[:, None]).long()
    return Batch(
        {
            "prompts": torch.ones(rows, 2, dtype=torch.long),
            "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
            "responses": torch.ones(rows, R, dtype=torch.long),
            "response_mask": mask,
            "group_ids": torch.arange(n_prompts).repeat_interleave(n),
        },
        {"ground_truth": ["1"] * rows, "data_source": [source] * rows, "extra_info": [{}] * rows},
        {"n": n},
    )


def test_invalid_rewards_are_counted_zero_advantage_and_masked_out(nan_scorer):
    batch, m = add_rewards(rollout(), ["1", "0", "nan", "1", "none", "inf"], SETTINGS, local)
    assert m["reward/invalid_count"] == 3.0
    assert batch.tensors["valid"].tolist() == [True, True, False, True, False, False]
    out, _ = add_advantages(batch, resolve(AlgorithmConfig(name="grpo")))
    adv, mask = out.tensors["advantages"], out.tensors["response_mask"]
    assert torch.isfinite(adv).all()
    assert (adv[[2, 4, 5]] == 0).all() and (mask[[2, 4, 5]] == 0).all()
    # group 0 is {1, 0} without the NaN row: mean 0.5, std 0.7071 -> +-0.7071; group 1 keeps one valid row
    torch.testing.assert_close(adv[:2, 0], torch.tensor([0.70710, -0.70710]), atol=1e-4, rtol=0)
    torch.testing.assert_close(adv[3, 0], torch.tensor(1.0 / (1 + 1e-6)))


def test_invalid_rewards_never_reach_the_loss(nan_scorer, tokenizer):
    from components.settings import UpdateSettings
    from components.training.actor import PolicyTrainer
    from tests.conftest import make_model

    texts = ["nan", "none", "inf", "nan", "none", "inf"]  # every reward invalid (a run would stop on it:
    batch, _ = add_rewards(rollout(), texts, ACCEPT_ALL, local)  # test_too_many_invalid_rewards_stop_the_run)
    batch, _ = add_advantages(batch, resolve(AlgorithmConfig(name="grpo")))
    torch.manual_seed(0)
    model = make_model(tokenizer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = PolicyTrainer(
        model,
        make_model(tokenizer, seed=1),
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        UpdateSettings(beta=0.1),
    )
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    metrics = trainer.update(batch)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    for k, v in model.named_parameters():  # nothing reached the loss, so nothing moved
        assert torch.equal(before[k], v.detach()), k


def test_too_many_invalid_rewards_stop_the_run(nan_scorer):
    from components.errors import RewardError

    batch = rollout()
    batch.meta["iteration"] = 1
    with pytest.raises(
        RewardError,
        match=r"iteration 1: 4 of 6 rewards are invalid .*'test/invalid'.* more than "
        r"reward\.max_invalid_frac=0\.5",
    ):
        add_rewards(batch, ["nan", "none", "inf", "nan", "1", "1"], SETTINGS, local)


def test_a_reward_of_the_wrong_type_names_the_function_sample_and_type():
    from components.errors import RewardError
    from components.rewards.registry import score_with_config

    def answers_yes(text, truth, extra):
        return text == truth  # a bool: 1.0 and 0.0 were meant, True reads as no reward at all

    REWARDS["test/bool"] = lambda rm: answers_yes
    try:
        with pytest.raises(
            RewardError,
            match=r"reward function .*answers_yes returned bool True for sample 0 "
            r"\(data_source 'test/bool', response '1'\)",
        ):
            score_with_config(["1", "2"], ["1", "1"], ["test/bool"] * 2, [{}, {}], REWARD_CFG)
    finally:
        del REWARDS["test/bool"]


def test_overlong_penalty_goes_into_rewards_not_scores():
    batch, m = add_rewards(
        rollout(1, 3, [2, 4, 5], "arith"),
        ["#### 1", "#### 1", "#### 2"],
        RewardSettings(overlong=(5, 2, 1.0)),
        local,
    )
    # lengths 2, 4, 5 with max 5, buffer 2: penalties 0, -0.5, -1
    torch.testing.assert_close(batch.tensors["scores"], torch.tensor([1.0, 1.0, 0.0]))
    torch.testing.assert_close(batch.tensors["token_rewards"].sum(-1), torch.tensor([1.0, 0.5, -1.0]))
    assert batch.tensors["token_rewards"][1, 3] == 0.5  # on the last response token
    assert math.isclose(m["reward/overlong_penalty_mean"], -0.5)


def test_greedy_baseline_is_scored_once_per_prompt_for_remax():
    calls = []

    def counting(text, truth, extra):
        calls.append(text)
        return float(text == truth)

    REWARDS["test/count"] = lambda rm: counting
    try:
        b = rollout(2, 3, source="test/count").union(
            baseline_responses=torch.ones(6, 2, dtype=torch.long),
            baseline_mask=torch.ones(6, 2, dtype=torch.long),
        )
        out, m = add_rewards(
            b, ["1", "0", "0", "0", "0", "1"], SETTINGS, local, baseline_texts=["1", "1", "1", "0", "0", "0"]
        )
    finally:
        del REWARDS["test/count"]
    assert len(calls) == 6 + 2
    torch.testing.assert_close(out.tensors["baseline_values"][:, 0], torch.tensor([1.0, 1, 1, 0, 0, 0]))
    adv, _ = add_advantages(out, resolve(AlgorithmConfig(name="remax")))
    torch.testing.assert_close(adv.tensors["advantages"][:, 0], torch.tensor([0.0, -1, -1, 0, 0, 1]))


def test_kl_in_reward_through_the_advantage_stage(nan_scorer):
    batch, _ = add_rewards(rollout(1, 2), ["1", "0"], SETTINGS, local)
    batch = batch.union(
        old_logprobs=torch.tensor([[-1.0, -1.0], [-1.0, -1.0]]),
        ref_logprobs=torch.tensor([[-2.0, -2.0], [-1.0, -1.0]]),
    )
    _, m = add_advantages(
        batch, resolve(AlgorithmConfig(name="reinforce_plus_plus")), kl_coef=0.1, kl_kind="k1"
    )
    assert math.isclose(m["actor/reward_kl_penalty"], 0.5)  # sequence KLs 1 and 0
    assert m["actor/reward_kl_penalty_coeff"] == 0.1


def test_dynamic_sampling_helpers():
    b = Batch({"scores": torch.tensor([1.0, 1, 0, 1, 0, 0]), "group_ids": torch.tensor([0, 0, 1, 1, 2, 2])})
    kept = informative_rows(b)
    assert kept.tensors["group_ids"].tolist() == [1, 1]
    both = concat_rounds([kept, kept])
    assert both.tensors["group_ids"].tolist() == [1, 1, 3, 3]  # rounds never share a group id
    assert first_groups(both, 1).tensors["group_ids"].tolist() == [1, 1]


def test_rounds_of_different_widths_concatenate_with_padding():
    a = Batch(
        {
            "prompts": torch.tensor([[5, 6]]),
            "prompt_mask": torch.tensor([[1, 1]]),
            "responses": torch.tensor([[7, 8, 9]]),
            "response_mask": torch.tensor([[1, 1, 1]]),
            "group_ids": torch.tensor([0]),
        }
    )
    b = Batch(
        {
            "prompts": torch.tensor([[4, 5, 6]]),
            "prompt_mask": torch.tensor([[1, 1, 1]]),
            "responses": torch.tensor([[7]]),
            "response_mask": torch.tensor([[1]]),
            "group_ids": torch.tensor([0]),
        }
    )
    both = concat_rounds([a, b])
    t = both.tensors
    assert t["prompts"].tolist() == [[0, 5, 6], [4, 5, 6]] and t["prompt_mask"].tolist() == [
        [0, 1, 1],
        [1, 1, 1],
    ]
    assert t["responses"].tolist() == [[7, 8, 9], [7, 0, 0]] and t["response_mask"].tolist() == [
        [1, 1, 1],
        [1, 0, 0],
    ]
    assert t["group_ids"].tolist() == [0, 1]


def test_a_run_that_rewards_nothing_in_its_first_iterations_says_so_once():
    from components.rl import ZERO_REWARD_ITERATIONS, zero_reward_warning

    zero = {"critic/score/max": 0.0, "critic/score/min": 0.0}
    history = [{"step": s, **zero} for s in range(1, ZERO_REWARD_ITERATIONS + 1)]
    line = zero_reward_warning(history, "arith: components.rewards.gsm8k.score")
    assert (
        line.startswith("iterations 1-3: every sample's reward was exactly 0 (scored by arith: ")
        and "\n" not in line
    )
    assert zero_reward_warning(history[:-1], "s") is None  # not yet
    assert zero_reward_warning(history + [{"step": 4, **zero}], "s") is None  # said once
    one_reward = [*history[:-1], {"step": 3, "critic/score/max": 0.1, "critic/score/min": 0.0}]
    assert zero_reward_warning(one_reward, "s") is None


def test_an_environments_figures_are_under_its_name():
    from components.rl import env_metrics, with_env_rewards

    batch = Batch(
        {
            "num_turns": torch.tensor([1, 3, 2, 2]),
            "env_reward": torch.tensor([1.0, 0.0, math.nan, 1.0]),
            "env_count/game_won": torch.tensor([1.0, 0.0, 0.0, 1.0]),
        },
        {"env": ["textarena"] * 4},
    )
    assert env_metrics(batch) == {
        "env/textarena/turns": 2.0,
        "env/textarena/reward": pytest.approx(2 / 3),
        "env/textarena/game_won": 0.5,
    }
    scores, given, invalid = with_env_rewards(torch.tensor([0.0, 1.0, 0.5, 0.0]), batch)
    assert scores.tolist() == [1.0, 0.0, 0.5, 1.0] and given.tolist() == [True, True, False, True]
    assert not invalid.any()


def test_a_mixtures_figures_are_each_environments_own():
    """Each sample's environment (the batch's `env`): turns, reward and declared counters over its own
    episodes; a counter no environment declares (context_full) for each of them."""
    from components.rl import env_metrics

    batch = Batch(
        {
            "num_turns": torch.tensor([1, 1, 3, 2]),
            "env_reward": torch.tensor([math.nan, math.nan, 0.0, 1.0]),
            "env_count/game_won": torch.tensor([0.0, 0.0, 0.0, 1.0]),
            "env_count/context_full": torch.tensor([0.0, 0.0, 1.0, 0.0]),
        },
        {"env": ["single", "single", "textarena", "textarena"]},
        {"env_counters": {"single": (), "textarena": ("game_won",)}},
    )
    assert env_metrics(batch) == {
        "env/single/turns": 1.0,
        "env/single/context_full": 0.0,
        "env/textarena/turns": 2.5,
        "env/textarena/reward": 0.5,
        "env/textarena/game_won": 0.5,
        "env/textarena/context_full": 0.5,
    }


def test_sampled_reverse_kl_advantages_bring_a_student_to_its_teacher():
    """distill_advantages' per-token signal through the PPO loss is the gradient of the reverse KL: a
    categorical student fed its own seeded samples reaches the teacher (KL 0.58 -> below 0.01 in 200 steps)."""
    from components.algorithms.losses import AggParams, vanilla_ppo
    from components.rl import distill_advantages
    from components.settings import DistillSettings, PolicyLossParams

    torch.manual_seed(0)
    teacher = torch.tensor([0.7, 0.1, 0.1, 0.05, 0.05]).log()
    logits = torch.zeros(5, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=1e-2)

    def kl() -> float:
        lp = torch.log_softmax(logits, -1).detach()
        return float((lp.exp() * (lp - teacher)).sum())

    start = kl()
    for _ in range(200):
        logp_all = torch.log_softmax(logits, -1)
        tokens = torch.multinomial(logp_all.exp().detach(), 64, replacement=True)[None]  # (1, 64)
        logp = logp_all[tokens]
        mask = torch.ones_like(logp)
        adv, _ = distill_advantages(
            torch.zeros_like(logp), logp.detach(), teacher[tokens], mask, DistillSettings()
        )
        loss, _ = vanilla_ppo(logp, logp.detach(), adv, mask, PolicyLossParams(), AggParams(64, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert start > 0.5 and kl() < 0.01, (start, kl())
