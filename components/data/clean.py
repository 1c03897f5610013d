"""One validation path for rows: the clean stage quarantines what fails it, the flows refuse a file that fails it.

A row is checked against the row schema (pandera, on a flat view of the row) after the types whose meaning is
unambiguous are normalised (an int ground truth becomes its string, a dict or list ground truth its JSON text),
then through the policy's tokenizer: its prompt must render and tokenize (`components.data.prompts`) without
the unknown token (unless data.allow_unk) and within data.max_prompt_len. Duplicates are found after Unicode
(NFKC) and whitespace normalisation; held-out rows whose prompt is also a training prompt are refused.

Nothing is dropped silently: every input row ends up either kept or quarantined with a `reason` (a short
kind), the `column` it concerns and a `detail`, and kept + quarantined = input is checked before anything is
written.
"""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pandera.pandas as pa

from components.data.formats import row_schema
from components.data.images import IMAGE_TOKEN, image_problem, image_ref
from components.data.io import read_rows, to_plain, write_parquet
from components.data.prompts import check_fits, encode_prompt, prompt_form, prompt_text
from components.errors import ConfigError, DataError
from components.rewards.registry import ScorerChoice
from components.settings import PromptSettings

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
QUARANTINE_COLUMNS = ["source_file", "source_row", "reason", "column", "detail", "row_json"]


@dataclass(frozen=True)
class RowRules:
    """What a row must satisfy beyond the schema (data.max_prompt_len, data.allow_unk, data.apply_chat_template)."""

    max_prompt_len: int
    allow_unk: bool = False
    prompts: PromptSettings = field(default_factory=PromptSettings)
    # tokens each `<image>` placeholder becomes for the policy (its processor's expansion); None = a text-only
    # policy, which refuses files with images
    image_tokens: int | None = None
    # which scorer each data_source gets: a ground truth it can never match is quarantined
    scorers: ScorerChoice = field(default_factory=ScorerChoice)

    @classmethod
    def from_config(cls, cfg, image_tokens: int | None = None) -> RowRules:
        d = cfg.data
        return cls(
            d.max_prompt_len,
            d.allow_unk,
            PromptSettings.from_config(cfg),
            image_tokens,
            ScorerChoice.from_config(cfg),
        )


@dataclass(frozen=True)
class Problem:
    reason: (
        str  # the kind: missing_column, missing, wrong_type, empty, prompt_form, unk_tokens, too_long, ...
    )
    column: str
    detail: str


def _is_str(v) -> bool:
    return isinstance(v, str)


def _non_blank(v) -> bool:
    return not isinstance(v, str) or bool(v.strip())


def _prompt_not_empty(v) -> bool:
    if v == []:
        return False
    return prompt_form(v) is None or bool(prompt_text(v).strip())


def _utf8(v) -> bool:
    try:
        prompt_text(v).encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: bytes that were never valid UTF-8
        return False
    return True


# The flat view of a row the schema checks; each check's name is the quarantine reason.
FLAT_SCHEMA = pa.DataFrameSchema(
    {
        "data_source": pa.Column(
            None,
            [
                pa.Check(_is_str, element_wise=True, name="wrong_type"),
                pa.Check(_non_blank, element_wise=True, name="empty"),
            ],
            nullable=False,
        ),
        "prompt": pa.Column(
            None,
            [
                pa.Check(
                    lambda v: prompt_form(v) is not None or v == [], element_wise=True, name="wrong_type"
                ),
                pa.Check(_prompt_not_empty, element_wise=True, name="empty"),
                pa.Check(
                    lambda v: prompt_form(v) is None or _utf8(v), element_wise=True, name="invalid_utf8"
                ),
            ],
            nullable=False,
        ),
        "ground_truth": pa.Column(
            None,
            [
                pa.Check(_is_str, element_wise=True, name="wrong_type"),
                pa.Check(_non_blank, element_wise=True, name="empty"),
            ],
            nullable=False,
        ),
    },
    coerce=False,
)
SCHEMA_COLUMNS = {
    "data_source": "data_source",
    "prompt": "prompt",
    "ground_truth": "reward_model.ground_truth",
}


def normalise_truth(value):
    """A ground truth as the string the scorers compare with, where its meaning is unambiguous: an int becomes
    its digits, a dict or list its JSON text (countdown's target and numbers, code's tests), and a string's
    decimal digits of any script (Arabic-Indic, Devanagari, fullwidth) become ASCII digits, which is what the
    scorers read in a response. Anything else (a float, a bool) is left for the schema to refuse.

    >>> normalise_truth(3), normalise_truth("3"), normalise_truth({"target": 4}), normalise_truth(3.5)
    ('3', '3', '{"target": 4}', 3.5)
    >>> normalise_truth("١٢٣"), normalise_truth("-४२"), normalise_truth("１０")
    ('123', '-42', '10')
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, str) and not value.isascii():
        return "".join(str(unicodedata.decimal(c)) if c.isdecimal() else c for c in value)
    return value


def _flat(records: list[dict]) -> pd.DataFrame:
    def truth(rec):
        rm = rec.get("reward_model")
        return normalise_truth(rm.get("ground_truth")) if isinstance(rm, dict) else None

    return pd.DataFrame(
        {
            "data_source": [r.get("data_source") for r in records],
            "prompt": [r.get("prompt") for r in records],
            "ground_truth": [truth(r) for r in records],
        },
        dtype=object,
    )


def _schema_problems(flat: pd.DataFrame) -> dict[int, Problem]:
    try:
        FLAT_SCHEMA.validate(flat, lazy=True)
        return {}
    except pa.errors.SchemaErrors as exc:
        problems: dict[int, Problem] = {}
        cases = exc.failure_cases.dropna(subset=["index"])
        for case in cases.itertuples():
            i, column = int(case.index), SCHEMA_COLUMNS.get(case.column, str(case.column))
            if i in problems:
                continue
            value = flat.at[i, case.column]
            if case.check == "not_nullable":
                problems[i] = Problem("missing", column, f"{column} is missing")
            elif case.check == "wrong_type":
                what = (
                    "a list of chat messages {role, content} or a string"
                    if case.column == "prompt"
                    else "a string"
                )
                problems[i] = Problem(
                    "wrong_type",
                    column,
                    f"{column} is {type(value).__name__} {str(value)[:40]!r}; it must be {what}",
                )
            else:
                problems[i] = Problem(str(case.check), column, f"{column} is {case.check.replace('_', ' ')}")
        return problems


def dedup_key(data_source: str, prompt, image_digest: str | None = None, extra_info=None) -> tuple:
    """Rows that say the same thing: Unicode compatibility forms folded (NFKC: full-width digits are digits)
    and runs of whitespace made one space; with images, the same picture bytes too; for a row whose episode an
    environment seeds from it (extra_info.env_seed: a game's rows, whose openings are all alike), the same
    seed too."""
    text = unicodedata.normalize("NFKC", prompt_text(prompt))
    key = (data_source, " ".join(text.split()))
    if image_digest:
        key = (*key, image_digest)
    seed = extra_info.get("env_seed") if isinstance(extra_info, dict) else None
    return (*key, f"env_seed={seed}") if seed is not None else key


def row_key(rec: dict) -> tuple:
    """dedup_key of a kept row (its images' digest read from their bytes)."""
    digest = None
    if rec.get("images"):
        digest = image_problem(rec["prompt"], rec["images"])[2]
    return dedup_key(rec["data_source"], rec["prompt"], digest, rec.get("extra_info"))


def _normalise(rec: dict) -> dict:
    """A kept row in the exact row format."""
    extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
    prompt = (
        rec["prompt"]
        if isinstance(rec["prompt"], str)
        else [{"role": m["role"], "content": m["content"]} for m in rec["prompt"]]
    )
    style = rec["reward_model"].get("style")
    images = {"images": [image_ref(e) for e in rec["images"]]} if rec.get("images") is not None else {}
    return {
        **images,
        "data_source": rec["data_source"],
        "prompt": prompt,
        "ability": rec.get("ability") if isinstance(rec.get("ability"), str) else "",
        "reward_model": {
            "style": style if isinstance(style, str) else "rule",
            "ground_truth": normalise_truth(rec["reward_model"]["ground_truth"]),
        },
        "extra_info": {
            "split": extra.get("split") if isinstance(extra.get("split"), str) else "",
            "index": int(extra["index"]) if isinstance(extra.get("index"), int) else -1,
            "answer": extra.get("answer") if isinstance(extra.get("answer"), str) else "",
            "question": extra.get("question") if isinstance(extra.get("question"), str) else "",
            **({"env_seed": int(extra["env_seed"])} if isinstance(extra.get("env_seed"), int) else {}),
        },
    }


class RowChecker:
    """Checks rows with one tokenizer and one set of rules; `train_keys` (dedup keys of the training rows) makes
    a held-out file refuse rows that are also training rows."""

    def __init__(self, tokenizer, rules: RowRules, train_keys: set | None = None, base: Path | None = None):
        """`base`: where relative image paths are found when not relative to the working directory."""
        self.tokenizer, self.rules = tokenizer, rules
        self.train_keys = train_keys or set()
        self.base = base

    def _check_vision(self, df: pd.DataFrame, source_file: str) -> None:
        """A file with images needs a vision-language policy: ConfigError naming actor.model.type if not."""
        has_images = "images" in df.columns and df["images"].map(lambda v: v is not None and len(v) > 0).any()
        if has_images and self.rules.image_tokens is None:
            raise ConfigError(
                f"{source_file} has images, but the policy is a text-only model (actor.model.type=text). "
                "Set actor.model.type=multimodal (with a vision-language actor.model.path or sft composing "
                "one), or give text-only data."
            )

    def _truth_problem(self, rec: dict) -> Problem | None:
        """A ground truth the row's scorer, with its own normalisation, can never match: trained on, it would
        score 0 whatever the model answered."""
        truth = normalise_truth(rec["reward_model"]["ground_truth"])
        why = self.rules.scorers.truth_problem(rec["data_source"], truth, rec.get("extra_info"))
        return Problem("unmatchable_truth", "reward_model.ground_truth", why) if why else None

    def _token_problem(self, prompt) -> Problem | None:
        ids = encode_prompt(self.tokenizer, prompt, self.rules.prompts)
        images = prompt_text(prompt).count(IMAGE_TOKEN) if self.rules.image_tokens else 0
        length = len(ids) + images * (self.rules.image_tokens or 1) - images
        unk = self.tokenizer.unk_token_id
        if unk is not None and unk in ids and not self.rules.allow_unk:
            bad = sorted(
                {
                    c
                    for c in prompt_text(prompt)
                    if self.tokenizer.unk_token_id in self.tokenizer(c, add_special_tokens=False)["input_ids"]
                }
            )
            return Problem(
                "unk_tokens",
                "prompt",
                f"characters outside the tokenizer's vocabulary: {bad[:8]!r} "
                "(data.allow_unk=true keeps such rows)",
            )
        if length > self.rules.max_prompt_len:
            with_images = f" ({images} image(s) of {self.rules.image_tokens} tokens)" if images else ""
            return Problem(
                "too_long",
                "prompt",
                f"prompt has {length} tokens{with_images} > data.max_prompt_len={self.rules.max_prompt_len}",
            )
        return None

    def check(self, df: pd.DataFrame, source_file: str) -> tuple[list[dict], list[dict]]:
        """(kept rows in the row format, quarantined rows with reason/column/detail), in input order."""
        records = [to_plain(r) for r in df.reset_index(drop=True).to_dict("records")]
        missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
        if missing:
            problems = {
                i: Problem(
                    "missing_column",
                    missing[0],
                    f"the file has no `{missing[0]}` column (required: {', '.join(REQUIRED_COLUMNS)})",
                )
                for i in range(len(records))
            }
        else:
            problems = _schema_problems(_flat(records))
        form, seen = None, {}
        for i, rec in enumerate(records):
            if i in problems:
                continue
            this = prompt_form(rec["prompt"])
            if form is None:
                form = this
                check_fits(self.tokenizer, form, self.rules.prompts, source_file)
                self._check_vision(df, source_file)
            digest = None
            if "images" in df.columns or IMAGE_TOKEN in prompt_text(rec["prompt"]):
                reason, detail, digest = image_problem(rec["prompt"], rec.get("images"), self.base)
                if reason:
                    problems[i] = Problem(reason, "images", detail)
                    continue
            if this != form:
                problems[i] = Problem(
                    "prompt_form",
                    "prompt",
                    f"a {this} prompt in a file of {form} prompts; one file holds one form",
                )
                continue
            problem = self._token_problem(rec["prompt"]) or self._truth_problem(rec)
            if problem is not None:
                problems[i] = problem
                continue
            key = dedup_key(rec["data_source"], rec["prompt"], digest, rec.get("extra_info"))
            if key in seen:
                problems[i] = Problem("duplicate", "prompt", f"duplicate of row {seen[key]}")
            elif key in self.train_keys:
                problems[i] = Problem(
                    "in_train",
                    "prompt",
                    "the same prompt is a training row; held-out rows must not be trained on",
                )
            else:
                seen[key] = i
        kept = [_normalise(r) for i, r in enumerate(records) if i not in problems]
        quarantined = [
            {
                "source_file": source_file,
                "source_row": i,
                "reason": problems[i].reason,
                "column": problems[i].column,
                "detail": problems[i].detail,
                "row_json": json.dumps(records[i], sort_keys=True, default=str),
            }
            for i in sorted(problems)
        ]
        if len(kept) + len(quarantined) != len(records):
            raise DataError(
                f"cleaning {source_file}: kept {len(kept)} + quarantined {len(quarantined)} != "
                f"{len(records)} input rows (a bug in reinforge; please report it)"
            )
        return kept, quarantined


def clean_rows(
    df: pd.DataFrame, tokenizer, rules: RowRules, source_file: str, train_keys: set | None = None
) -> tuple[list[dict], list[dict]]:
    """Split rows into (kept rows, quarantined rows with reasons); the input's order is kept."""
    return RowChecker(tokenizer, rules, train_keys).check(df, source_file)


@dataclass
class CleanReport:
    input_rows: int
    kept: int
    quarantined: int
    reasons: dict[str, int]
    clean_path: str
    quarantine_path: str


def clean_file(
    src: str | Path,
    dst: str | Path,
    quarantine_dir: str | Path,
    tokenizer,
    rules: RowRules,
    train_keys: set | None = None,
) -> CleanReport:
    """Clean one file: the kept rows to `dst`, the rejected ones to `quarantine_dir/<dst's name>`. When no row
    survives, the quarantine file is still written, a previous `dst` is removed (it would look valid to the
    next stage), and DataError names the quarantine file."""
    df = read_rows(src, key="input data")
    kept, quarantined = RowChecker(tokenizer, rules, train_keys, Path(src).parent).check(df, str(src))
    qpath = Path(quarantine_dir) / (Path(dst).stem + ".parquet")
    write_parquet(quarantined, qpath, schema=None if quarantined else _empty_quarantine_schema())
    counts = dict(sorted(Counter(q["reason"] for q in quarantined).items()))
    if not kept:
        Path(dst).unlink(missing_ok=True)
        first = (
            f"row {quarantined[0]['source_row']}: {quarantined[0]['detail']}"
            if quarantined
            else "the file is empty"
        )
        raise DataError(
            f"{src}: all {len(df)} rows were quarantined ({counts or 'none'}), written to {qpath}; the "
            f"first: {first}. Fix the data and run `reinforge clean` again."
        )
    write_parquet(
        kept,
        dst,
        schema=row_schema(
            prompt_form(kept[0]["prompt"]),
            images="images" in kept[0],
            env_seed="env_seed" in kept[0]["extra_info"],
        ),
    )
    return CleanReport(len(df), len(kept), len(quarantined), counts, str(dst), str(qpath))


def validate_file(
    path: str | Path, key: str, tokenizer, rules: RowRules, train_keys: set | None = None
) -> list[dict]:
    """The rows of a file a flow is about to use, each checked as the clean stage checks it. DataError naming
    the file, the first bad rows, their column and reason when any row fails (nothing is quarantined here:
    the flow stops before any work, and `reinforge clean` sorts the file)."""
    df = read_rows(path, key=key)
    kept, bad = RowChecker(tokenizer, rules, train_keys, Path(path).parent).check(df, str(path))
    if bad:
        shown = "; ".join(
            f"row {q['source_row']}, column {q['column']}: {q['reason']} ({q['detail']})" for q in bad[:3]
        )
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise DataError(
            f"{key}={path}: {len(bad)} of {len(df)} rows fail validation: {shown}{more}. Fix the file, or "
            f"quarantine them: `reinforge clean data.raw_dir={Path(path).parent}` cleans its train and test "
            "files (docs/data.md)."
        )
    if not kept:
        raise DataError(f"{key}={path} has no rows; give it a file with rows (docs/data.md)")
    return kept


def _empty_quarantine_schema():
    import pyarrow

    types = {"source_row": pyarrow.int64()}
    return pyarrow.schema([(c, types.get(c, pyarrow.string())) for c in QUARANTINE_COLUMNS])
