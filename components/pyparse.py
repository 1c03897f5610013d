"""Python's parser for the scorers, one thread at a time.

CPython 3.11 keeps the AST constructor's recursion depth in state the whole interpreter shares
(python/cpython#106905): two threads that build trees at once can fail with "SystemError: AST constructor
recursion depth mismatch". The scorers run in threads (the reward actor's, a local run's) and parse tests,
answers and equations, so every parse of ours takes this lock.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """ast.parse, under the lock.

    >>> type(parse("1 + 2", mode="eval").body).__name__
    'BinOp'
    """
    with _LOCK:
        return ast.parse(source, mode=mode)


def literal(text: str):
    """ast.literal_eval of text, parsed under the lock.

    >>> literal("[1, 'a', (2.5,)]")
    [1, 'a', (2.5,)]
    """
    return ast.literal_eval(parse(text, mode="eval"))
