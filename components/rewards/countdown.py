"""Countdown scorer: an equation that uses each given number exactly once and evaluates to the target.

The equation is parsed with `ast` and evaluated by walking the tree (numbers, + - * /, parentheses and unary
minus only) with exact fractions; nothing is ever passed to `eval`.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction

from components.pyparse import parse

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_EQUATION_TAIL = re.compile(r"[\d\s+\-*/()]+$")
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
MAX_CHARS = 200  # longer "equations" are not parsed


class BadEquation(ValueError):
    pass


def _walk(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _walk(node.left, used), _walk(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise BadEquation("division by zero")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_walk(node.operand, used)
    raise BadEquation(f"not allowed in an equation: {type(node).__name__}")


def evaluate(equation: str) -> tuple[Fraction, list[int]]:
    """The exact value of `equation` and the numbers it uses, in order.

    >>> evaluate("(25 - 5) * 3 / 4")
    (Fraction(15, 1), [25, 5, 3, 4])
    >>> evaluate("__import__('os')")
    Traceback (most recent call last):
    ...
    components.rewards.countdown.BadEquation: not allowed in an equation: Call
    """
    if len(equation) > MAX_CHARS:
        raise BadEquation(f"equation longer than {MAX_CHARS} characters")
    try:
        tree = parse(equation.strip(), mode="eval")
    except SyntaxError as exc:
        raise BadEquation(f"not an equation: {exc.msg}") from None
    used: list[int] = []
    return _walk(tree, used), used


def extract_equation(text: str) -> str | None:
    """The last `<answer>...</answer>`, or else the left side of the last line with `=`, or None."""
    found = _ANSWER.findall(text)
    if found:
        return found[-1].split("=")[0].strip()
    lines = [line for line in text.strip().splitlines() if "=" in line]
    if not lines:
        return None
    tail = _EQUATION_TAIL.search(lines[-1].split("=")[0])  # the arithmetic just before the `=`
    return tail.group(0).strip() if tail else None


def _parse_truth(ground_truth, extra_info: dict | None) -> tuple[int, list[int]]:
    """ground_truth is {"target": t, "numbers": [...]} (as JSON text or a dict); extra_info may hold them."""
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    truth = {**(extra_info or {}), **(truth if isinstance(truth, dict) else {"target": truth})}
    return int(truth["target"]), [int(x) for x in truth["numbers"]]


def score(
    response_text: str, ground_truth, extra_info: dict | None = None, *, format_score: float = 0.1
) -> float:
    """1.0 for a correct equation, format_score for a well-formed but wrong one (wrong value, a number reused
    or missing, a disallowed token), 0.0 when no equation is found.

    >>> truth = '{"target": 24, "numbers": [4, 6, 1]}'
    >>> score("<answer>4 * 6 * 1</answer>", truth)
    1.0
    >>> score("<answer>4 * 6</answer>", truth)  # 1 is not used
    0.1
    >>> score("<answer>4 * 6 * 1 * 1</answer>", truth)  # 1 is used twice
    0.1
    >>> score("I give up", truth)
    0.0
    """
    target, numbers = _parse_truth(ground_truth, extra_info)
    equation = extract_equation(response_text)
    if not equation:
        return 0.0
    try:
        value, used = evaluate(equation)
    except BadEquation:
        return format_score
    if Counter(used) != Counter(numbers):
        return format_score
    return 1.0 if value == target else format_score
