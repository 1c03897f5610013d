"""reasoning-gym's procedural tasks as rows and rewards: generated locally from a seed (nothing downloaded),
scored by each task's own `score_answer`.

A row keeps what regenerates its entry: data_source `reasoning_gym/<task>`, extra_info's split and index.
The scorer builds the same dataset (the task's settings from data.reasoning_gym, the split's seed) and scores
the response against entry `index`, metadata included, as reasoning-gym's own evaluation does; an entry whose
question is not the row's (a settings change since the data was made) is an error naming the row's task.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from components.errors import RewardError

SOURCE_PREFIX = "reasoning_gym/"
# each split has a seed of its own, so the held-out entries are other draws than the training ones
SPLIT_SEEDS = {"train": 0, "test": 1_000_003}


@cache
def _dataset(name: str, settings: str, seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(settings))


def dataset(name: str, settings: dict | None, seed: int, size: int):
    # the settings as JSON: a hashable key even when a value is a list (basic_arithmetic's operators)
    return _dataset(name, json.dumps(settings or {}, sort_keys=True), seed, size)


def rows(tasks: dict[str, dict[str, Any]], num_train: int, num_eval: int, seed: int) -> tuple[list, list]:
    """num_train and num_eval rows shared out among `tasks` (the first ones get the remainder); the SFT answer
    is the task's answer itself."""
    from components.data.formats import make_row

    def split(total: int, name: str) -> list[dict]:
        out = []
        share, extra = divmod(total, len(tasks))
        for k, (task, settings) in enumerate(tasks.items()):
            size = share + (k < extra)
            ds = dataset(task, settings, seed + SPLIT_SEEDS[name], size)
            for i in range(size):
                entry = ds[i]
                answer = str(entry["answer"])
                out.append(
                    make_row(SOURCE_PREFIX + task, entry["question"], answer, answer, name, i, "reasoning")
                )
        return out

    return split(num_train, "train"), split(num_eval, "test")


def extract(response_text: str) -> str:
    """The answer in a response: inside <answer>...</answer> when the model writes the tags (reasoning-gym's
    convention for larger models), else the response itself, stripped."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(response_text)
    return (tagged if tagged is not None else response_text).strip()


def score(
    response_text: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    data_source: str,
    tasks: dict[str, dict[str, Any]],
    seed: int,
) -> float:
    """The reward of a reasoning-gym row: its task's score_answer (in [0, 1]) on the entry regenerated from
    `tasks` (data.reasoning_gym) and `seed` (trainer.seed)."""
    import reasoning_gym

    task = data_source.removeprefix(SOURCE_PREFIX)
    info = extra_info or {}
    if task not in tasks:
        raise RewardError(
            f"data_source={data_source}: task {task!r} is not in data.reasoning_gym "
            f"({', '.join(tasks) or 'empty'}); score it with the settings that made the data"
        )
    split, index = info.get("split", "train"), int(info.get("index", 0))
    entry = dataset(task, tasks[task], seed + SPLIT_SEEDS.get(split, 0), index + 1)[index]
    if info.get("question") not in (None, entry["question"]):
        raise RewardError(
            f"data_source={data_source}, {split} row {index}: its question is not the one reasoning-gym "
            "makes from data.reasoning_gym and trainer.seed now; run `reinforge prepare` again"
        )
    return float(reasoning_gym.get_score_answer_fn(task)(extract(response_text), entry))
