"""MATH-style scorer: the last `\\boxed{...}` of the response, checked for equivalence with math-verify.

math-verify parses both sides to sympy (LaTeX fractions, decimals, sets, intervals) and compares them, so
`\\boxed{\\dfrac{1}{2}}` equals a ground truth of `0.5`.
"""

from __future__ import annotations

import threading

from math_verify import parse, verify


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched; None when there is none.

    >>> last_boxed("so \\\\boxed{1} then \\\\boxed{\\\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    >>> last_boxed("\\\\boxed{\\\\text{a {b}}}")
    '\\\\text{a {b}}'
    >>> last_boxed("no box") is None
    True
    """
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
        i += 1
    return None  # unbalanced: the box was cut off


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    return 5 if threading.current_thread() is threading.main_thread() else None


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """Whether two LaTeX answers are the same value (exact string match first, then math-verify).

    >>> is_equivalent("\\\\dfrac{1}{2}", "0.5")
    True
    >>> is_equivalent("\\\\frac{2}{4}", "\\\\frac{1}{2}")
    True
    >>> is_equivalent("3", "4")
    False
    """
    if answer.replace(" ", "") == ground_truth.replace(" ", ""):
        return True
    timeout = _timeout()
    gold = parse(f"${ground_truth}$", parsing_timeout=timeout)
    pred = parse(f"${answer}$", parsing_timeout=timeout)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))


def score(
    response_text: str, ground_truth: str, extra_info: dict | None = None, *, format_score: float = 0.0
) -> float:
    """1.0 when the last boxed answer equals the ground truth, format_score when boxed but wrong, else 0.0.

    >>> score("The answer is \\\\boxed{\\\\dfrac{1}{2}}", "0.5")
    1.0
    >>> score("\\\\boxed{0.25}", "\\\\frac{1}{2}", format_score=0.1)
    0.1
    >>> score("1/2", "0.5")
    0.0
    """
    answer = last_boxed(response_text)
    if answer is None:
        return 0.0
    ground = last_boxed(ground_truth) or ground_truth
    return 1.0 if is_equivalent(answer, ground) else format_score
