"""GSM8K rule scorer, as verl's: the last 300 characters, `#### N` extraction, exact string match."""

from __future__ import annotations

import re
import unicodedata

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
# a comma is a thousands separator only between groups of three digits: `1,2` is not 12
_GROUPED = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
# the answers a well-formed response gives: no sign but a minus, no leading zeros, no trailing zeros or dot
_CANONICAL = re.compile(r"-?(0|[1-9]\d*)(\.\d*[1-9])?")


def _uncomma(candidate: str) -> str | None:
    """The candidate without its thousands separators; None when a comma is anywhere else."""
    if "," not in candidate:
        return candidate
    return candidate.replace(",", "") if _GROUPED.fullmatch(candidate) else None


def truth_problem(truth) -> str | None:
    """Why no well-formed answer can ever match `truth` under this scorer (exact match of the extracted number),
    or None. A ground truth must be a canonical number: `-7`, `1234`, `2.5`.

    >>> truth_problem("1234") is None
    True
    >>> truth_problem("1,234")
    'has a thousands separator, which extracted answers drop: write 1234'
    """
    if not isinstance(truth, str):
        return f"is a {type(truth).__name__}, not the text of a number"
    if _CANONICAL.fullmatch(truth):
        return None
    hidden = [c for c in truth if unicodedata.category(c) in ("Cf", "Cc", "Zs", "Zl", "Zp")]
    if hidden:
        return f"holds an invisible or direction character (U+{ord(hidden[0]):04X}): remove it"
    plain = truth.replace(",", "")
    suggestion = ""
    try:
        value = float(plain.replace("\u2212", "-"))
        suggestion = f": write {int(value) if value.is_integer() else repr(value)}"
    except ValueError:
        pass
    if truth.startswith("+"):
        return f"has a leading +, which no extracted answer has{suggestion}"
    if "," in truth:
        return f"has a thousands separator, which extracted answers drop{suggestion}"
    if "\u2212" in truth:
        return f"has a Unicode minus (U+2212), not -{suggestion}"
    if re.fullmatch(r"-?[0-9.]*[eE][-+]?[0-9]+", truth):
        return f"is in exponent form{suggestion}"
    if re.fullmatch(r"-?[0-9]+\.?[0-9]*", truth):
        return f"is not in the plain form an answer takes (leading or trailing zeros, a trailing dot){suggestion}"
    return "is not a number this scorer extracts (digits, with a minus and a decimal point)"


def extract_answer(text: str, method: str = "strict") -> str | None:
    """The final answer in `text`, or None.

    >>> extract_answer("so 3+4 is 7\\n#### 7")
    '7'
    >>> extract_answer("#### 1,234$")
    '1234'
    >>> extract_answer("#### 1,2") is None  # not a thousands separator: a malformed answer
    True
    >>> extract_answer("the answer is 12", method="flexible")
    '12'
    >>> extract_answer("no answer") is None
    True
    """
    text = text[-300:]
    if method == "strict":
        found = _STRICT.findall(text)
        return _uncomma(found[-1]) if found else None
    for candidate in reversed(_FLEXIBLE.findall(text)):
        if candidate not in ("", ".") and (plain := _uncomma(candidate)) is not None:
            return plain
    return None


def score(
    response_text: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """1.0 for an exact match, format_score for an extracted but wrong answer, 0.0 when nothing is extracted.

    >>> score("#### 46", "46")
    1.0
    >>> score("#### 45", "46", format_score=0.1)
    0.1
    >>> score("46", "46")
    0.0
    """
    answer = extract_answer(response_text, method)
    if answer is None:
        return 0.0
    return correct_score if answer == ground_truth else format_score
