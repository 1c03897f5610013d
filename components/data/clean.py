"""Cleaning: validate rows against the schema, quarantine failures, duplicates and over-long prompts.

Nothing is dropped silently: every input row ends up either in the clean file or in the quarantine file
with a `reason`, and kept + quarantined = input is checked before anything is written.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import pandera.pandas as pa

from components.data.formats import ROW_SCHEMA, prompt_text
from components.data.io import read_rows, to_plain, write_parquet
from components.errors import DataError


def _non_blank(s: pd.Series) -> pd.Series:
    return s.str.strip().str.len() > 0


# The flattened view of a row that the schema checks (nested parquet structs are unpacked first).
FLAT_SCHEMA = pa.DataFrameSchema(
    {
        "data_source": pa.Column(str, pa.Check(_non_blank, error="data_source is empty"), nullable=False),
        "prompt_text": pa.Column(str, pa.Check(_non_blank, error="prompt is empty"), nullable=False),
        "ground_truth": pa.Column(str, pa.Check(_non_blank, error="ground_truth is empty"), nullable=False),
        "ability": pa.Column(str, nullable=False),
    },
    coerce=False,
)

QUARANTINE_COLUMNS = ["source_file", "source_row", "reason", "row_json"]


@dataclass
class CleanReport:
    input_rows: int
    kept: int
    quarantined: int
    reasons: dict[str, int]
    clean_path: str
    quarantine_path: str


def _get(d, key):
    return d.get(key) if isinstance(d, dict) else None


def _str_or_none(x):
    return x if isinstance(x, str) else None


def _flatten(df: pd.DataFrame) -> pd.DataFrame:
    col = lambda name: df[name] if name in df.columns else pd.Series([None] * len(df), index=df.index)  # noqa
    return pd.DataFrame({
        "data_source": col("data_source").map(_str_or_none),
        "prompt_text": col("prompt").map(prompt_text),
        "ground_truth": col("reward_model").map(lambda r: _str_or_none(_get(r, "ground_truth"))),
        "ability": col("ability").map(lambda a: a if isinstance(a, str) else ("" if a is None else None)),
    }, index=df.index)


def _schema_failures(flat: pd.DataFrame) -> dict[int, str]:
    try:
        FLAT_SCHEMA.validate(flat, lazy=True)
        return {}
    except pa.errors.SchemaErrors as exc:
        reasons: dict[int, str] = {}
        for case in exc.failure_cases.itertuples():
            if pd.isna(case.index):
                continue
            what = case.check if "empty" in str(case.check) else f"{case.column}: {case.check}"
            reasons.setdefault(int(case.index), f"schema: {what}")
        return reasons


def _normalise(rec: dict) -> dict:
    """A kept row in the exact row format (numpy arrays from parquet back to lists)."""
    rec = to_plain(rec)
    extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
    return {
        "data_source": rec["data_source"],
        "prompt": rec["prompt"] if isinstance(rec["prompt"], list) else [{"role": "user", "content": rec["prompt"]}],
        "ability": rec.get("ability") or "",
        "reward_model": {"style": rec["reward_model"].get("style") or "rule",
                         "ground_truth": rec["reward_model"]["ground_truth"]},
        "extra_info": {"split": _str_or_none(extra.get("split")) or "",
                       "index": int(extra["index"]) if isinstance(extra.get("index"), int) else -1,
                       "answer": _str_or_none(extra.get("answer")) or "",
                       "question": _str_or_none(extra.get("question")) or ""},
    }


def clean_rows(df: pd.DataFrame, count_tokens: Callable[[str], int], max_prompt_len: int,
               source_file: str) -> tuple[list[dict], list[dict]]:
    """Split rows into (kept rows, quarantined rows with reasons); order of the input is kept."""
    df = df.reset_index(drop=True)
    flat = _flatten(df)
    reasons = _schema_failures(flat)
    seen: dict[tuple, int] = {}
    for i, row in flat.iterrows():
        if i in reasons:
            continue
        try:
            row.prompt_text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: bytes that were never valid UTF-8
            reasons[i] = "prompt is not valid UTF-8"
            continue
        key = (row.data_source, row.prompt_text)
        if key in seen:
            reasons[i] = f"duplicate of row {seen[key]}"
            continue
        n_tok = count_tokens(row.prompt_text)
        if n_tok > max_prompt_len:
            reasons[i] = f"too long: prompt has {n_tok} tokens > data.max_prompt_len={max_prompt_len}"
            continue
        seen[key] = i
    records = df.to_dict("records")
    kept = [_normalise(r) for i, r in enumerate(records) if i not in reasons]
    quarantined = [{"source_file": source_file, "source_row": i, "reason": reasons[i],
                    "row_json": json.dumps(to_plain(records[i]), sort_keys=True, default=str)}
                   for i in sorted(reasons)]
    if len(kept) + len(quarantined) != len(df):
        raise DataError(f"cleaning {source_file}: kept {len(kept)} + quarantined {len(quarantined)} != "
                        f"{len(df)} input rows (a bug in reinforge; please report it)")
    return kept, quarantined


def clean_file(src: str | Path, dst: str | Path, quarantine_dir: str | Path,
               count_tokens: Callable[[str], int], max_prompt_len: int) -> CleanReport:
    """Clean one file: write the kept rows to `dst` and the rejected ones to `quarantine_dir/<name>`."""
    df = read_rows(src, key="input data")
    kept, quarantined = clean_rows(df, count_tokens, max_prompt_len, str(src))
    if not kept:
        raise DataError(f"{src}: all {len(df)} rows were quarantined (see {quarantine_dir}); the first reason: "
                        f"{quarantined[0]['reason'] if quarantined else 'file is empty'}. Fix the data.")
    qpath = Path(quarantine_dir) / (Path(dst).stem + ".parquet")
    write_parquet(quarantined, qpath, schema=None if quarantined else _empty_quarantine_schema())
    write_parquet(kept, dst, schema=ROW_SCHEMA)
    counts = Counter(_reason_kind(q["reason"]) for q in quarantined)
    return CleanReport(len(df), len(kept), len(quarantined), dict(sorted(counts.items())), str(dst), str(qpath))


def _reason_kind(reason: str) -> str:
    """`schema: prompt is empty` -> `schema`; `duplicate of row 3` -> `duplicate`."""
    return reason.split(":")[0].split(" of ")[0]


def _empty_quarantine_schema():
    import pyarrow

    return pyarrow.schema([("source_file", pyarrow.string()), ("source_row", pyarrow.int64()),
                           ("reason", pyarrow.string()), ("row_json", pyarrow.string())])
