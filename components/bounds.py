"""How much a value built from untrusted input (a row's tests, a model directory's chat template) costs to walk,
so that an evaluator can refuse it before building something larger."""

from __future__ import annotations

DEFAULT_BUDGET = 1 << 20


def weight(value, budget: int = DEFAULT_BUDGET) -> int:
    """What walking `value` costs (comparing it, printing it, copying it): characters of a string, 64-bit words
    of an integer, 1 per other scalar, and the weights of a container's items, a shared item counted each time
    it appears. Stops counting past `budget` (the answer is then budget + 1): never slower than the budget."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += 1 + len(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            total += 1 + v.bit_length() // 64
        elif isinstance(v, dict):
            total += 1
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 1
            stack.extend(v)
        else:
            total += 1
        if total > budget:
            return budget + 1
    return total
