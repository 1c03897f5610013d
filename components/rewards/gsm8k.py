"""GSM8K rule scorer, as verl's: the last 300 characters, `#### N` extraction, exact string match."""

from __future__ import annotations

import re

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def extract_answer(text: str, method: str = "strict") -> str | None:
    """The final answer in `text`, or None.

    >>> extract_answer("so 3+4 is 7\\n#### 7")
    '7'
    >>> extract_answer("#### 1,234$")
    '1234'
    >>> extract_answer("the answer is 12", method="flexible")
    '12'
    >>> extract_answer("no answer") is None
    True
    """
    text = text[-300:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_FLEXIBLE.findall(text)):
        if candidate not in ("", "."):
            return candidate.replace(",", "")
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
