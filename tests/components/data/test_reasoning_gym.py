"""reasoning-gym's tasks as rows and rewards: generated from the seed, scored by each task's own scorer."""

from __future__ import annotations

import pytest

from components.config.schema import check_reasoning_gym_tasks
from components.data import reasoning_gym as rg
from components.errors import RewardError

TASKS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
}


def test_rows_share_the_sizes_out_and_regenerate_from_the_seed():
    train, test = rg.rows(TASKS, 7, 4, seed=3)
    sources = [r["data_source"] for r in train]
    assert sources == ["reasoning_gym/chain_sum"] * 4 + ["reasoning_gym/spell_backward"] * 3
    assert [r["data_source"] for r in test] == ["reasoning_gym/chain_sum"] * 2 + [
        "reasoning_gym/spell_backward"
    ] * 2
    assert rg.rows(TASKS, 7, 4, seed=3) == (train, test)  # the same seed, the same rows
    assert rg.rows(TASKS, 7, 4, seed=4)[0] != train
    first = train[0]
    assert first["prompt"][0]["content"].startswith("State the final answer")
    assert first["reward_model"]["ground_truth"] == first["extra_info"]["answer"]
    assert {r["extra_info"]["split"] for r in test} == {"test"}


def test_the_tasks_own_scorer_rewards_the_answer_and_nothing_else():
    train, test = rg.rows(TASKS, 4, 4, seed=0)
    for row in train + test:

        def score(text: str, row: dict = row) -> float:
            info, source = row["extra_info"], row["data_source"]
            return rg.score(text, "", info, data_source=source, tasks=TASKS, seed=0)

        answer = row["reward_model"]["ground_truth"]
        assert score(answer) == 1.0 and score(f" {answer}\n") == 1.0
        assert score(f"thinking... <answer>{answer}</answer>") == 1.0  # reasoning-gym's own tags
        assert score("zz") == 0.0


def test_a_row_made_with_other_settings_is_an_error_naming_it():
    (row, *_), _ = rg.rows(TASKS, 2, 1, seed=0)
    other = {**TASKS, "chain_sum": {**TASKS["chain_sum"], "min_digits": 3, "max_digits": 3}}
    with pytest.raises(RewardError, match=r"reasoning_gym/chain_sum, train row 0: .*run `reinforge prepare`"):
        rg.score("1", "1", row["extra_info"], data_source=row["data_source"], tasks=other, seed=0)
    with pytest.raises(RewardError, match="task 'gcd' is not in data.reasoning_gym"):
        rg.score("1", "1", {}, data_source="reasoning_gym/gcd", tasks=TASKS, seed=0)


def test_the_registry_gives_each_task_its_scorer():
    from components.config import load_config
    from components.rewards.registry import scorer_for

    cfg = load_config("configs/rg_grpo.yaml", [])
    (row, *_), _ = rg.rows(cfg.data.reasoning_gym, 1, 1, cfg.trainer.seed)
    fn = scorer_for(row["data_source"], cfg)
    assert fn(row["reward_model"]["ground_truth"], "", row["extra_info"]) == 1.0


def test_unknown_tasks_and_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"nope: no such reasoning-gym task; valid tasks: .*chain_sum"):
        check_reasoning_gym_tasks({"nope": {}})
    with pytest.raises(ValueError, match=r"chain_sum: .*bogus"):
        check_reasoning_gym_tasks({"chain_sum": {"bogus": 1}})
    # accepted by the task's own check, refused only when an entry is made: still the config's error
    with pytest.raises(ValueError, match=r"simple_equations: its settings fail: .*number of weights"):
        check_reasoning_gym_tasks({"simple_equations": {"operators": ["+", "-"]}})
    with pytest.raises(ValueError, match="needs data.reasoning_gym"):
        check_reasoning_gym_tasks({})


def test_the_command_line_refuses_an_unknown_task_naming_the_key():
    """`reinforge prepare` with a task reasoning-gym does not have: the config's error (exit 2, no traceback)
    names data.reasoning_gym and the task."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "flows.cli", "prepare", "--config", "configs/rg_grpo.yaml"]
        + ["data.reasoning_gym={nope: {}}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "data.reasoning_gym: Value error, nope: no such reasoning-gym task" in res.stderr


def test_list_settings_make_rows_and_score_them():
    """A setting given as a list (YAML has no tuples): basic_arithmetic's operators."""
    tasks = {
        "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "operators": ["+"], "allow_negation": False}
    }
    train, _ = rg.rows(tasks, 3, 1, seed=0)
    assert all(" + " in r["prompt"][0]["content"] for r in train)
    row = train[0]
    truth = row["reward_model"]["ground_truth"]
    kwargs = {"data_source": row["data_source"], "tasks": tasks, "seed": 0}
    assert rg.score(truth, truth, row["extra_info"], **kwargs) == 1.0
