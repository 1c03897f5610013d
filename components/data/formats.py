"""verl's row format, the arithmetic task generator, and the GSM8K importer.

A row: data_source (str), prompt (chat messages, or a plain string: TRL's standard format), ability (str),
reward_model {style, ground_truth}, extra_info {split, index, answer, question}.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pyarrow as pa

from components.data.io import read_rows
from components.errors import DataError

ARITH_SOURCE = "arith"
ARITH_TOOL_SOURCE = "arith_tool"
GSM8K_SOURCE = "openai/gsm8k"

# an image as verl stores it: its encoded bytes, or a path (relative to the project, or absolute)
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def row_schema(form: str = "messages", images: bool = False, env_seed: bool = False) -> pa.Schema:
    """The parquet schema of rows whose prompts are chat messages ("messages") or plain strings ("text"),
    with an `images` column (verl's {bytes, path} entries) when `images`, and extra_info.env_seed (the seed of
    the episode an environment plays for the row: a game's rows) when `env_seed`."""
    extra = [("images", pa.list_(IMAGE_TYPE))] if images else []
    seeded = [("env_seed", pa.int64())] if env_seed else []
    return pa.schema(
        extra
        + [
            ("data_source", pa.string()),
            ("prompt", MESSAGES_TYPE if form == "messages" else pa.string()),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [
                        ("split", pa.string()),
                        ("index", pa.int64()),
                        ("answer", pa.string()),
                        ("question", pa.string()),
                        *seeded,
                    ]
                ),
            ),
        ]
    )


ROW_SCHEMA = row_schema("messages")


def make_row(
    source: str, question: str, answer: str, ground_truth: str, split: str, index: int, ability: str = "math"
) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def tool_answer(expression: str, result: int) -> str:
    """A calculator trajectory as one SFT answer: the call, the tool's output (masked out of the SFT loss), the
    final answer."""
    from components.rollout.tools import tool_call_text

    return (
        tool_call_text("calculator", {"expression": expression})
        + f"<tool_response>{result}</tool_response>#### {result}"
    )


def arithmetic_rows(
    num_train: int,
    num_eval: int,
    max_operand: int,
    operations: list[str],
    seed: int,
    tool_fraction: float | None = None,
) -> tuple[list[dict], list[dict]]:
    """Distinct two-operand problems `a+b=` with answers `#### N`, split into disjoint train and eval sets.
    tool_fraction (the arith_tool task) makes that share of the answers calculator trajectories, data_source
    `arith_tool`."""
    problems = [
        (a, op, b) for op in operations for a in range(max_operand + 1) for b in range(max_operand + 1)
    ]
    if num_train + num_eval > len(problems):
        raise DataError(
            f"data.num_train + data.num_eval = {num_train + num_eval} exceeds the {len(problems)} "
            "distinct problems; raise data.max_operand or ask for fewer"
        )
    random.Random(seed).shuffle(problems)
    pick = random.Random(seed + 1)

    def rows(chunk, split):
        out = []
        for i, (a, op, b) in enumerate(chunk):
            result = _OPS[op](a, b)
            if tool_fraction is None:
                out.append(make_row(ARITH_SOURCE, f"{a}{op}{b}=", f"#### {result}", str(result), split, i))
                continue
            answer = tool_answer(f"{a}{op}{b}", result) if pick.random() < tool_fraction else f"#### {result}"
            out.append(make_row(ARITH_TOOL_SOURCE, f"{a}{op}{b}=", answer, str(result), split, i))
        return out

    return rows(problems[:num_train], "train"), rows(problems[num_train : num_train + num_eval], "test")


_GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9.,]+)")


def gsm8k_rows(path: str | Path, split: str, key: str = "data.gsm8k_path") -> list[dict]:
    """Import a local GSM8K file (`question` / `answer` columns, jsonl or parquet) into the row format.

    Ground truth is the text after `#### ` with commas removed. A row whose answer has no `#### N` keeps an
    empty ground truth, so cleaning quarantines it with a reason instead of dropping it here.
    """
    df = read_rows(path, key=key)
    missing = {"question", "answer"} - set(df.columns)
    if missing:
        raise DataError(
            f"{key}={path}: columns {sorted(missing)} missing; a GSM8K file has `question` and `answer`"
        )
    out = []
    for i, rec in enumerate(df.to_dict("records")):
        answer = rec.get("answer") if isinstance(rec.get("answer"), str) else ""
        match = _GSM8K_ANSWER.search(answer)
        truth = match.group(1).replace(",", "") if match else ""
        question = rec.get("question") if isinstance(rec.get("question"), str) else ""
        out.append(make_row(GSM8K_SOURCE, question, answer, truth, split, i))
    return out


def gsm8k_splits(
    train_path: str | Path, test_path: str | Path | None, num_eval: int, seed: int
) -> tuple[list[dict], list[dict]]:
    """Disjoint train and test rows from GSM8K files: the test file when given (data.gsm8k_test_path), else a
    seeded held-out split of `num_eval` questions from the train file. A question in both files is left for
    the clean stage, which quarantines the held-out copy (`in_train`): no accuracy is measured on trained rows."""
    train = gsm8k_rows(train_path, "train")
    if test_path:
        test = gsm8k_rows(test_path, "test", key="data.gsm8k_test_path")
    else:
        if num_eval >= len(train):
            raise DataError(
                f"data.gsm8k_path={train_path} has {len(train)} rows, too few to hold out "
                f"data.num_eval={num_eval} for testing; lower data.num_eval or give "
                "data.gsm8k_test_path"
            )
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        held = set(order[:num_eval])
        test = [
            {**r, "extra_info": {**r["extra_info"], "split": "test"}}
            for i, r in enumerate(train)
            if i in held
        ]
        train = [r for i, r in enumerate(train) if i not in held]
    return train, test
