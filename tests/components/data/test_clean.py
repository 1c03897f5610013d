"""Cleaning: bad rows are quarantined with their true reason, never dropped; output is deterministic."""

import hashlib
import json

import pandas as pd
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from components.data.clean import RowRules, clean_file, clean_rows, validate_file
from components.data.formats import ROW_SCHEMA, arithmetic_rows, gsm8k_rows, gsm8k_splits, make_row
from components.data.io import write_parquet
from components.errors import ConfigError, DataError
from components.models import build_char_tokenizer

TOK = build_char_tokenizer()  # one token per printable ASCII character
RULES = RowRules(max_prompt_len=16)


def good(i, q=None):
    return make_row("arith", q or f"{i}+1=", f"#### {i + 1}", str(i + 1), "train", i)


def reasons_of(quarantined):
    return {q["source_row"]: (q["reason"], q["column"]) for q in quarantined}


def test_malformed_rows_are_quarantined_with_their_true_reason():
    rows = [
        good(1),
        good(2),
        good(1),  # a duplicate of row 0
        {**good(3), "prompt": [{"role": "user", "content": "   "}]},
        {**good(4), "reward_model": {"style": "rule", "ground_truth": None}},
        {**good(5), "data_source": 7},
        good(6, "9" * 40),
        {**good(7), "reward_model": {"style": "rule", "ground_truth": 3.5}},
        {**good(8), "prompt": 12},
        {**good(9), "prompt": []},
    ]
    kept, quarantined = clean_rows(pd.DataFrame(rows), TOK, RULES, "x.parquet")
    assert [r["extra_info"]["index"] for r in kept] == [1, 2]
    assert reasons_of(quarantined) == {
        2: ("duplicate", "prompt"),
        3: ("empty", "prompt"),
        4: ("missing", "reward_model.ground_truth"),
        5: ("wrong_type", "data_source"),
        6: ("too_long", "prompt"),
        7: ("wrong_type", "reward_model.ground_truth"),
        8: ("wrong_type", "prompt"),
        9: ("empty", "prompt"),
    }
    detail = {q["source_row"]: q["detail"] for q in quarantined}
    assert detail[2] == "duplicate of row 0" and "data.max_prompt_len=16" in detail[6]
    assert "float" in detail[7] and "must be a string" in detail[7]
    assert len(kept) + len(quarantined) == len(rows)
    assert json.loads(quarantined[0]["row_json"])["extra_info"]["index"] == 1


def test_unambiguous_types_are_normalised_not_rejected():
    rows = [
        {**good(1), "reward_model": {"style": "rule", "ground_truth": 3}},
        {  # countdown's target and numbers: its scorer's truth, not arith's
            **good(2),
            "data_source": "countdown",
            "reward_model": {"ground_truth": {"target": 4, "numbers": [1, 3]}},
            "ability": None,
        },
    ]
    kept, quarantined = clean_rows(pd.DataFrame(rows), TOK, RULES, "x")
    assert not quarantined
    assert kept[0]["reward_model"]["ground_truth"] == "3"  # an int ground truth would score 0 against '3'
    assert json.loads(kept[1]["reward_model"]["ground_truth"]) == {"target": 4, "numbers": [1, 3]}
    assert kept[1]["ability"] == "" and kept[1]["reward_model"]["style"] == "rule"


def test_ground_truth_digits_of_any_script_become_what_the_scorer_reads():
    """An Arabic-Indic or fullwidth ground truth is the same number: normalised to ASCII digits, so a right
    answer scores 1 instead of every reward being 0."""
    from components.rewards.gsm8k import score

    rows = [
        {**good(i), "reward_model": {"ground_truth": truth}} for i, truth in enumerate(["١٢٣", "-४२", "１０"])
    ]
    kept, quarantined = clean_rows(pd.DataFrame(rows), TOK, RULES, "x")
    assert not quarantined and [r["reward_model"]["ground_truth"] for r in kept] == ["123", "-42", "10"]
    assert score("#### 123", kept[0]["reward_model"]["ground_truth"]) == 1.0


def test_text_outside_the_vocabulary_is_quarantined_unless_allowed():
    rows = [good(1, "１+２="), good(2, "1\x00+2="), good(3, "\u200f1+2="), good(4, "1+2=🙂"), good(5, "1+2=")]
    kept, quarantined = clean_rows(pd.DataFrame(rows), TOK, RULES, "x")
    assert [r["prompt"][0]["content"] for r in kept] == ["1+2="]
    assert {q["reason"] for q in quarantined} == {"unk_tokens"}
    assert "'１'" in quarantined[0]["detail"] and "data.allow_unk=true" in quarantined[0]["detail"]
    # allowed, the full-width row is kept; its ASCII twin is then a duplicate of it after NFKC normalisation
    kept, quarantined = clean_rows(pd.DataFrame([rows[0], rows[4]]), TOK, RowRules(16, allow_unk=True), "x")
    assert len(kept) == 1 and quarantined[0]["detail"] == "duplicate of row 0"


def test_plain_string_prompts_are_kept_as_strings():
    rows = [
        {"data_source": "arith", "prompt": "12+3=", "reward_model": {"ground_truth": "15"}},
        {
            "data_source": "arith",
            "prompt": [{"role": "user", "content": "1+1="}],
            "reward_model": {"ground_truth": "2"},
        },
    ]
    kept, quarantined = clean_rows(pd.DataFrame(rows), TOK, RULES, "x")
    assert kept[0]["prompt"] == "12+3=" and kept[0]["extra_info"]["index"] == -1
    assert reasons_of(quarantined) == {1: ("prompt_form", "prompt")}


def test_messages_need_a_chat_template(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(
        ConfigError,
        match=r"data\.apply_chat_template: the tokenizer .* has no chat template.*"
        r"chat messages",
    ):
        clean_rows(pd.DataFrame([good(1)]), tok, RULES, "x")
    with pytest.raises(ConfigError, match=r"data\.apply_chat_template=false, but the prompts in x are chat"):
        clean_rows(pd.DataFrame([good(1)]), TOK, RowRules(16, prompts=_settings(False)), "x")
    string_rows = pd.DataFrame(
        [{"data_source": "arith", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}}]
    )
    assert len(clean_rows(string_rows, tok, RULES, "x")[0]) == 1
    with pytest.raises(ConfigError, match=r"data\.apply_chat_template=true\)"):
        clean_rows(string_rows, tok, RowRules(16, prompts=_settings(True)), "x")


def _settings(value):
    from components.settings import PromptSettings

    return PromptSettings(value)


def test_a_missing_column_is_named():
    df = pd.DataFrame([{"data_source": "arith", "prompt": "1+1="}])
    _, quarantined = clean_rows(df, TOK, RULES, "x")
    assert reasons_of(quarantined) == {0: ("missing_column", "reward_model")}


def test_held_out_rows_seen_in_training_are_quarantined():
    kept, quarantined = clean_rows(
        pd.DataFrame([good(1), good(2)]), TOK, RULES, "test", train_keys={("arith", "1+1=")}
    )
    assert len(kept) == 1 and reasons_of(quarantined) == {0: ("in_train", "prompt")}


def test_rows_alike_but_for_the_game_their_seed_names_are_kept_and_keep_the_seed(tmp_path):
    """A game's openings are all alike: rows naming other games (extra_info.env_seed) are other rows, the same
    game twice is a duplicate, and the seed survives cleaning (the environment replays the game from it)."""
    from components.data.formats import row_schema

    def game(seed):
        return {**good(1), "extra_info": {**good(1)["extra_info"], "env_seed": seed}}

    kept, quarantined = clean_rows(pd.DataFrame([game(7), game(8), game(7)]), TOK, RULES, "test")
    assert [r["extra_info"]["env_seed"] for r in kept] == [7, 8]
    assert reasons_of(quarantined) == {2: ("duplicate", "prompt")}
    src = write_parquet([game(7), game(8)], tmp_path / "raw.parquet", row_schema(env_seed=True))
    clean_file(src, tmp_path / "clean.parquet", tmp_path / "q", TOK, RULES)
    assert [r["extra_info"]["env_seed"] for r in pq.read_table(tmp_path / "clean.parquet").to_pylist()] == [
        7,
        8,
    ]


def test_clean_file_writes_both_and_is_byte_identical(tmp_path):
    train, _ = arithmetic_rows(50, 5, 20, ["+"], 0)
    rows = train + [train[0]]
    src = write_parquet(rows, tmp_path / "raw.parquet", ROW_SCHEMA)
    digests = []
    for run in range(2):
        out = tmp_path / f"run{run}"
        r = clean_file(src, out / "clean.parquet", out / "q", TOK, RULES)
        assert (r.input_rows, r.kept, r.quarantined, r.reasons) == (51, 50, 1, {"duplicate": 1})
        digests.append(hashlib.sha256((out / "clean.parquet").read_bytes()).hexdigest())
        q = pq.read_table(out / "q" / "clean.parquet").to_pylist()
        assert q[0]["detail"] == "duplicate of row 0"
    assert digests[0] == digests[1]


def test_missing_file_names_it(tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet does not exist.*reinforge prepare"):
        clean_file(tmp_path / "nope.parquet", tmp_path / "c.parquet", tmp_path / "q", TOK, RULES)


def test_all_rows_bad_names_the_quarantine_it_wrote_and_leaves_no_stale_clean_file(tmp_path):
    src = write_parquet([{**good(1), "prompt": [{"role": "user", "content": ""}]}], tmp_path / "raw.parquet")
    (tmp_path / "c.parquet").write_text("an older clean file")
    with pytest.raises(DataError, match=r"all 1 rows were quarantined .* written to .*q/c\.parquet") as err:
        clean_file(src, tmp_path / "c.parquet", tmp_path / "q", TOK, RULES)
    assert (tmp_path / "q" / "c.parquet").is_file() and "row 0: prompt is empty" in str(err.value)
    assert pq.read_table(tmp_path / "q" / "c.parquet").to_pylist()[0]["reason"] == "empty"
    assert not (tmp_path / "c.parquet").exists()


def test_validate_file_names_the_file_row_and_column(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"data_source": "arith", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}},
                {"data_source": "arith", "prompt": "2+2=", "reward_model": {"ground_truth": None}},
            ]
        )
    )
    with pytest.raises(
        DataError,
        match=r"data\.train_path=.*train\.jsonl: 1 of 2 rows fail validation: row 1, "
        r"column reward_model\.ground_truth: missing",
    ):
        validate_file(path, "data.train_path", TOK, RULES)


def test_gsm8k_import(tmp_path):
    p = tmp_path / "gsm8k.jsonl"
    p.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "question": "Tom has 2 apples and buys 1,000 more. How many?",
                    "answer": "2+1000=1002\n#### 1,002",
                },
                {"question": "Broken row", "answer": "no final answer"},
            ]
        )
    )
    rows = gsm8k_rows(p, "train")
    assert rows[0]["reward_model"]["ground_truth"] == "1002" and rows[0]["data_source"] == "openai/gsm8k"
    kept, quarantined = clean_rows(pd.DataFrame(rows), TOK, RowRules(200), str(p))
    assert len(kept) == 1 and reasons_of(quarantined) == {1: ("empty", "reward_model.ground_truth")}


def _gsm8k_file(path, questions):
    path.write_text(
        "\n".join(json.dumps({"question": q, "answer": f"#### {i}"}) for i, q in enumerate(questions))
    )
    return path


def test_gsm8k_train_and_test_never_overlap(tmp_path):
    """One file: a seeded held-out split; two files: as given, and the clean stage refuses any shared question."""
    questions = [f"What is {i} plus {i}?" for i in range(40)]
    train, test = gsm8k_splits(_gsm8k_file(tmp_path / "train.jsonl", questions), None, 10, seed=0)
    asked = lambda rows: {r["extra_info"]["question"] for r in rows}  # noqa: E731
    assert len(test) == 10 and len(train) == 30 and not asked(train) & asked(test)
    assert gsm8k_splits(tmp_path / "train.jsonl", None, 10, seed=0) == (train, test)  # seeded
    _gsm8k_file(tmp_path / "test.jsonl", questions[:3] + ["A new question?"])
    train, test = gsm8k_splits(tmp_path / "train.jsonl", tmp_path / "test.jsonl", 10, seed=0)
    assert len(train) == 40 and len(test) == 4
    rules = RowRules(200, allow_unk=True)
    kept_train, _ = clean_rows(pd.DataFrame(train), TOK, rules, "train")
    from components.data.clean import dedup_key

    keys = {dedup_key(r["data_source"], r["prompt"]) for r in kept_train}
    kept_test, quarantined = clean_rows(pd.DataFrame(test), TOK, rules, "test", keys)
    assert asked(kept_test) == {"A new question?"} and {q["reason"] for q in quarantined} == {"in_train"}
    with pytest.raises(DataError, match="too few to hold out"):
        gsm8k_splits(tmp_path / "test.jsonl", None, 10, seed=0)


def test_generator_splits_are_disjoint():
    train, test = arithmetic_rows(300, 50, 20, ["+", "-"], 3)
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    with pytest.raises(DataError, match="exceeds"):
        arithmetic_rows(1000, 1000, 5, ["+"], 0)


_text = st.one_of(
    st.text(max_size=30),
    st.just(""),
    st.none(),
    st.integers(),
    st.binary(max_size=8),
    st.floats(allow_nan=True),
    st.booleans(),
)
_row = st.fixed_dictionaries(
    {
        "data_source": st.one_of(st.just("arith"), _text),
        "prompt": st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": _text}), max_size=2), _text
        ),
        "ability": st.one_of(st.just("math"), _text),
        "reward_model": st.one_of(
            st.fixed_dictionaries({"style": st.just("rule"), "ground_truth": _text}), st.none()
        ),
        "extra_info": st.fixed_dictionaries({"index": st.one_of(st.integers(0, 3), st.none())}),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_row, min_size=1, max_size=12))
def test_fuzzed_rows_are_kept_or_quarantined_never_lost(rows):
    kept, quarantined = clean_rows(pd.DataFrame(rows), TOK, RowRules(16, allow_unk=True), "fuzz")
    assert len(kept) + len(quarantined) == len(rows)
    assert all(q["reason"] and q["column"] and q["detail"] for q in quarantined)
    from components.data.prompts import prompt_text

    for r in kept:
        assert prompt_text(r["prompt"]).strip() and r["reward_model"]["ground_truth"].strip()
    again_kept, again_q = clean_rows(pd.DataFrame(rows), TOK, RowRules(16, allow_unk=True), "fuzz")
    assert again_kept == kept and again_q == quarantined


def test_a_fifo_or_a_directory_given_as_data_is_named_without_waiting(tmp_path):
    """Opening a FIFO would wait for a writer forever, and 'does not exist' would be untrue: each is one line
    saying what the path is."""
    import os

    from components.data.io import read_rows

    fifo = tmp_path / "rows.parquet"
    os.mkfifo(fifo)
    with pytest.raises(
        DataError, match=r"data.train_path: .*rows.parquet is a FIFO \(named pipe\), not a regular file"
    ):
        read_rows(fifo, "data.train_path")
    with pytest.raises(DataError, match="is a directory, not a regular file"):
        read_rows(tmp_path, "data.train_path")
    with pytest.raises(DataError, match="does not exist"):
        read_rows(tmp_path / "missing.parquet", "data.train_path")


UNMATCHABLE = {
    "+5": "has a leading +",
    "1,234": "has a thousands separator",
    "1e3": "is in exponent form: write 1000",
    "5.0": "not in the plain form an answer takes",
    "007": "not in the plain form an answer takes",
    "12\u200b": "invisible or direction character (U+200B)",
    "\u202e21": "invisible or direction character (U+202E)",
    "\u22125": "Unicode minus (U+2212)",
    "\u216b": "is not a number this scorer extracts",  # a Roman numeral twelve
    "\u5341\u4e8c": "is not a number this scorer extracts",  # twelve in CJK numerals
    "1/2": "is not a number this scorer extracts",
    " 7": "invisible or direction character (U+0020)",
}


def test_ground_truths_the_scorer_can_never_match_are_quarantined_with_the_reason():
    """The gsm8k scorer (arith's) compares the number it extracts with the ground truth: these never match any
    well-formed answer, so each row is quarantined naming why and what to write; the others are kept."""
    rows = [{**good(i), "reward_model": {"ground_truth": t}} for i, t in enumerate(UNMATCHABLE)]
    rows += [
        {**good(50 + i), "reward_model": {"ground_truth": t}} for i, t in enumerate(["-3", "2.5", "0", "١٢"])
    ]
    kept, quarantined = clean_rows(pd.DataFrame(rows), TOK, RULES, "x")
    assert [r["reward_model"]["ground_truth"] for r in kept] == ["-3", "2.5", "0", "12"]
    assert len(quarantined) == len(UNMATCHABLE) and len(kept) + len(quarantined) == len(rows)
    for q, (truth, why) in zip(quarantined, UNMATCHABLE.items()):
        assert (q["reason"], q["column"]) == ("unmatchable_truth", "reward_model.ground_truth"), q
        assert q["detail"].startswith("the gsm8k scorer can never match this ground truth: it "), q
        assert why in q["detail"], (truth, q["detail"])


def test_a_custom_reward_or_a_mapped_scorer_decides_which_truths_match():
    from components.rewards.registry import ScorerChoice

    rows = [{**good(0), "reward_model": {"ground_truth": "1,234"}}]
    custom = RowRules(max_prompt_len=16, scorers=ScorerChoice(custom=True))  # its own normalisation: kept
    assert len(clean_rows(pd.DataFrame(rows), TOK, custom, "x")[0]) == 1
    code = RowRules(max_prompt_len=16, scorers=ScorerChoice(sources=(("arith", "code"),)))
    bad_tests = [
        {**good(0), "reward_model": {"ground_truth": "not json"}},
        {**good(1), "reward_model": {"ground_truth": '["import os"]'}},
        {**good(2), "reward_model": {"ground_truth": '["assert f(1) == 2"]'}},
    ]
    kept, quarantined = clean_rows(pd.DataFrame(bad_tests), TOK, code, "x")
    assert len(kept) == 1 and [q["reason"] for q in quarantined] == ["unmatchable_truth"] * 2
    assert "is not a JSON list of tests" in quarantined[0]["detail"]
    assert "is not one `assert <expression>`" in quarantined[1]["detail"]
