"""Cleaning: bad rows are quarantined with a reason, never dropped; output is deterministic."""

import hashlib
import json

import pandas as pd
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from components.data.clean import clean_file, clean_rows
from components.data.formats import ROW_SCHEMA, arithmetic_rows, gsm8k_rows, make_row
from components.data.io import write_parquet
from components.errors import DataError

COUNT = len  # one token per character, like the tiny tokenizer


def good(i, q=None):
    return make_row("arith", q or f"{i}+1=", f"#### {i + 1}", str(i + 1), "train", i)


def test_malformed_rows_are_quarantined_with_reasons():
    rows = [good(1), good(2), good(1),  # a duplicate of row 0
            {**good(3), "prompt": [{"role": "user", "content": "   "}]},  # empty prompt
            {**good(4), "reward_model": {"style": "rule", "ground_truth": None}},  # missing ground truth
            {**good(5), "data_source": 7},  # wrong type
            good(6, "9" * 40)]  # over-long prompt
    kept, quarantined = clean_rows(pd.DataFrame(rows), COUNT, 16, "x.parquet")
    assert [r["extra_info"]["index"] for r in kept] == [1, 2]
    reasons = {q["source_row"]: q["reason"] for q in quarantined}
    assert reasons[2] == "duplicate of row 0"
    assert "prompt is empty" in reasons[3]
    assert "ground_truth" in reasons[4]
    assert "data_source" in reasons[5]
    assert "data.max_prompt_len=16" in reasons[6]
    assert len(kept) + len(quarantined) == len(rows)
    assert json.loads(quarantined[0]["row_json"])["extra_info"]["index"] == 1


def test_clean_file_writes_both_and_is_byte_identical(tmp_path):
    train, _ = arithmetic_rows(50, 5, 20, ["+"], 0)
    rows = train + [train[0]]
    src = write_parquet(rows, tmp_path / "raw.parquet", ROW_SCHEMA)
    digests = []
    for run in range(2):
        out = tmp_path / f"run{run}"
        r = clean_file(src, out / "clean.parquet", out / "q", COUNT, 16)
        assert (r.input_rows, r.kept, r.quarantined) == (51, 50, 1)
        digests.append(hashlib.sha256((out / "clean.parquet").read_bytes()).hexdigest())
        q = pq.read_table(out / "q" / "clean.parquet").to_pylist()
        assert q[0]["reason"] == "duplicate of row 0"
    assert digests[0] == digests[1]


def test_missing_file_names_it(tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet does not exist.*reinforge prepare"):
        clean_file(tmp_path / "nope.parquet", tmp_path / "c.parquet", tmp_path / "q", COUNT, 16)


def test_all_rows_bad_is_an_error_and_writes_no_clean_file(tmp_path):
    src = write_parquet([{**good(1), "prompt": [{"role": "user", "content": ""}]}], tmp_path / "raw.parquet")
    with pytest.raises(DataError, match="all 1 rows were quarantined"):
        clean_file(src, tmp_path / "c.parquet", tmp_path / "q", COUNT, 16)
    assert not (tmp_path / "c.parquet").exists()


def test_gsm8k_import(tmp_path):
    p = tmp_path / "gsm8k.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"question": "Tom has 2 apples and buys 1,000 more. How many?", "answer": "2+1000=1002\n#### 1,002"},
        {"question": "Broken row", "answer": "no final answer"}]))
    rows = gsm8k_rows(p, "train")
    assert rows[0]["reward_model"]["ground_truth"] == "1002" and rows[0]["data_source"] == "openai/gsm8k"
    kept, quarantined = clean_rows(pd.DataFrame(rows), COUNT, 200, str(p))
    assert len(kept) == 1 and "ground_truth is empty" in quarantined[0]["reason"]


def test_generator_splits_are_disjoint():
    train, test = arithmetic_rows(300, 50, 20, ["+", "-"], 3)
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    with pytest.raises(DataError, match="exceeds"):
        arithmetic_rows(1000, 1000, 5, ["+"], 0)


_text = st.one_of(st.text(max_size=30), st.just(""), st.none(), st.integers(), st.binary(max_size=8))
_row = st.fixed_dictionaries({
    "data_source": st.one_of(st.just("arith"), _text),
    "prompt": st.one_of(st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": _text}), max_size=2),
                        _text),
    "ability": st.one_of(st.just("math"), _text),
    "reward_model": st.one_of(st.fixed_dictionaries({"style": st.just("rule"), "ground_truth": _text}), st.none()),
    "extra_info": st.fixed_dictionaries({"index": st.one_of(st.integers(0, 3), st.none())}),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_row, min_size=1, max_size=12))
def test_fuzzed_rows_are_kept_or_quarantined_never_lost(rows):
    kept, quarantined = clean_rows(pd.DataFrame(rows), COUNT, 16, "fuzz")
    assert len(kept) + len(quarantined) == len(rows)
    assert all(q["reason"] for q in quarantined)
    for r in kept:
        assert "".join(m["content"] for m in r["prompt"]).strip() and r["reward_model"]["ground_truth"].strip()
    again_kept, again_q = clean_rows(pd.DataFrame(rows), COUNT, 16, "fuzz")
    assert again_kept == kept and again_q == quarantined
