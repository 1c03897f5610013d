"""Code scorer: the response's Python against the sample's tests, judged by a process that never runs it.

ground_truth (or extra_info["tests"]) is a JSON list of test statements, e.g. `["assert add(1, 2) == 3"]`.
The solution runs alone in the bubblewrap sandbox (a Sandbox.session). Each test is evaluated here, in the
host, by a small interpreter of plain values: literals, arithmetic, comparisons, `and`/`or`/`not`, indexing,
a few safe builtins (len, abs, sorted, ...) and `math.isclose`; every call to any other name is a call of the
solution's function, sent to the sandbox with the argument values, which answers with the repr of its result.
That answer is parsed as a literal (ast.literal_eval) and compared here, so nothing the solution does in its
own process (patching builtins, printing markers, objects whose `__eq__` says yes, exiting early, killing the
harness, reading the tests, which are never sent) can pass a test it does not pass. The score is the fraction
of tests passed; how the run ended is a sub-score (`status/<s>` = 1):

- ok: every test was evaluated; error: the solution raised while loading (its functions defined before that
  still answer); exited: the program ended before all tests were asked (sys.exit, os._exit, a killed harness);
  tampered: it answered what was not asked (a forged or malformed reply on the result pipe); timeout, memory,
  output_limit, processes: a limit of the whole process tree was reached. A run that ended any other way than
  ok or error scores 0, whatever it answered before.

A test that is not `assert <expression>` (or a bare expression) over that language is a malformed ground
truth: a ValueError naming it, as for a ground truth that is not a list of tests.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import time
from functools import lru_cache

from components.bounds import weight
from components.pyparse import parse
from components.rewards.sandbox import Sandbox, SessionClosed
from components.settings import SandboxLimits

STATUSES = ("ok", "error", "exited", "tampered", "timeout", "memory", "output_limit", "processes")
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)

SAFE_CALLS = {
    "abs": abs,
    "len": len,
    "round": round,
    "sorted": sorted,
    "set": set,
    "list": list,
    "tuple": tuple,
    "min": min,
    "max": max,
    "sum": sum,
    "all": all,
    "any": any,
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "dict": dict,
    "frozenset": frozenset,
}
SAFE_MATH = {
    "isclose": math.isclose,
    "sqrt": math.sqrt,
    "floor": math.floor,
    "ceil": math.ceil,
    "fabs": math.fabs,
    "isnan": math.isnan,
    "isinf": math.isinf,
}
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
MAX_SIZE = 1 << 20  # the most a value the host builds while evaluating a test may weigh (weight())
MAX_BITS = 1 << 16  # the largest integer it builds (Python refuses to print more than 4300 digits anyway)
MAX_TEST_CHARS = 20_000  # a test longer than this is a malformed ground truth, refused before it is parsed
MAX_TESTS = 1_000
TEST_SECONDS = 2.0  # the host's own work on one test (the solution's calls have the sandbox's limits)


class Unsupported(ValueError):
    """A test the host-side evaluator does not take (a malformed ground truth)."""


class _Failed(Exception):
    """A call of the solution raised, or answered with something that is not a plain value."""


def extract_code(text: str) -> str:
    """The last fenced code block of the response, or the whole response when it has none.

    >>> extract_code("Here:\\n```python\\nx = 1\\n```\\ndone")
    'x = 1\\n'
    >>> extract_code("y = 2")
    'y = 2'
    """
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def parse_test(test: str) -> ast.expr:
    """The expression a test asserts; Unsupported naming the test when it is not `assert <expr>` or `<expr>`,
    or is longer than MAX_TEST_CHARS (checked before it is parsed).

    >>> ast.dump(parse_test("assert f(1) == 2"))[:7]
    'Compare'
    """
    if len(test) > MAX_TEST_CHARS:
        raise Unsupported(
            f"code reward: a test of {len(test)} characters ({test[:40]!r}...); a test is one assert of at most "
            f"{MAX_TEST_CHARS}"
        )
    try:
        body = parse(test).body
    except (SyntaxError, RecursionError, MemoryError) as exc:
        if not isinstance(exc, SyntaxError):
            raise Unsupported(f"code reward: test {test[:60]!r}... is nested too deeply to parse") from None
        raise Unsupported(f"code reward: test {test!r} is not Python ({exc.msg})") from None
    if len(body) == 1 and isinstance(body[0], ast.Assert):
        return body[0].test
    if len(body) == 1 and isinstance(body[0], ast.Expr):
        return body[0].value
    raise Unsupported(
        f"code reward: test {test!r} is not one `assert <expression>`; the tests are evaluated "
        "outside the solution's process, over calls of its functions, literals, arithmetic, "
        "comparisons and len/abs/sorted/... (components/rewards/code_exec.py)"
    )


def _bounded(value):
    if weight(value) > MAX_SIZE:
        raise _Failed("a value too large to compare")
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_binop(op: ast.operator, left, right) -> None:
    """_Failed before an operation whose result would be too large to build (a repeated sequence, a product or
    power of integers past MAX_BITS, string formatting): its operands are each bounded, its result may not be."""
    if isinstance(op, ast.Mult):
        if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_BITS:
            raise _Failed("a product too large to evaluate")
        for seq, times in ((left, right), (right, left)):
            repeated = isinstance(seq, (str, bytes, list, tuple)) and _is_int(times)
            if repeated and weight(seq) * max(times, 0) > MAX_SIZE:
                raise _Failed("a repetition too large to evaluate")
    elif isinstance(op, ast.Pow) and _is_int(left) and _is_int(right) and right > 0:
        if abs(left) > 1 and left.bit_length() * right > MAX_BITS:
            raise _Failed("an exponent too large to evaluate")
    elif isinstance(op, ast.Mod) and isinstance(left, (str, bytes)):
        raise _Failed("string formatting is not evaluated (a width can build any size)")


def _check_call(name: str, args: tuple) -> None:
    """_Failed before a safe call that would take too long: sum() over sequences (a quadratic concatenation)."""
    if name != "sum" or not args:
        return
    items = args[0] if isinstance(args[0], (list, tuple, set, frozenset)) else ()
    if any(isinstance(v, (str, bytes, list, tuple)) for v in (*items, *args[1:])):
        raise _Failed("sum() over sequences is not evaluated")


class Evaluator:
    """Evaluates a test expression over plain values; `call(name, args, kwargs)` answers the solution's calls."""

    def __init__(self, call, seconds: float = TEST_SECONDS):
        self.call, self.seconds = call, seconds
        self.deadline = None

    def evaluate(self, expression: ast.expr):
        """One test's value, its host-side work bounded by `seconds` (the solution's calls excepted)."""
        self.deadline = time.monotonic() + self.seconds
        try:
            return self(expression)
        except RecursionError:
            raise _Failed("a test nested too deeply") from None

    def __call__(self, node: ast.AST):
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise _Failed(f"the test took more than {self.seconds:g} s to evaluate")
        method = getattr(self, f"_{type(node).__name__}", None)
        if method is None:
            raise Unsupported(
                f"code reward: `{ast.unparse(node)}` ({type(node).__name__}) is outside what tests may use"
            )
        return _bounded(method(node))

    def _Constant(self, node):
        return node.value

    def _List(self, node):
        return [self(e) for e in node.elts]

    def _Tuple(self, node):
        return tuple(self(e) for e in node.elts)

    def _Set(self, node):
        return {self(e) for e in node.elts}

    def _Dict(self, node):
        return {self(k): self(v) for k, v in zip(node.keys, node.values)}

    def _UnaryOp(self, node):
        if type(node.op) not in _UNARY:
            raise Unsupported(f"code reward: operator in `{ast.unparse(node)}`")
        return _UNARY[type(node.op)](self(node.operand))

    def _BinOp(self, node):
        if type(node.op) not in _BINARY:
            raise Unsupported(f"code reward: operator in `{ast.unparse(node)}`")
        left, right = self(node.left), self(node.right)
        _check_binop(node.op, left, right)
        return _BINARY[type(node.op)](left, right)

    def _BoolOp(self, node):
        value = None
        for operand in node.values:
            value = self(operand)
            if isinstance(node.op, ast.And) and not value or isinstance(node.op, ast.Or) and value:
                return value
        return value

    def _Compare(self, node):
        left = self(node.left)
        for op, comparator in zip(node.ops, node.comparators):
            right = self(comparator)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True

    def _Subscript(self, node):
        return self(node.value)[self(node.slice)]

    def _Slice(self, node):
        return slice(*(self(p) if p is not None else None for p in (node.lower, node.upper, node.step)))

    def _Call(self, node):
        args = tuple(self(a) for a in node.args)
        kwargs = {k.arg: self(k.value) for k in node.keywords if k.arg is not None}
        if len(kwargs) != len(node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            raise Unsupported(f"code reward: `{ast.unparse(node)}` unpacks arguments")
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "math"
            and func.attr in SAFE_MATH
        ):
            return SAFE_MATH[func.attr](*args, **kwargs)
        if not isinstance(func, ast.Name):
            raise Unsupported(
                f"code reward: `{ast.unparse(node)}` calls something other than a function by name"
            )
        if func.id in SAFE_CALLS:
            _check_call(func.id, args)
            return SAFE_CALLS[func.id](*args, **kwargs)
        kind, value = self.call(func.id, args, kwargs)  # the solution's function, in the sandbox
        if kind != "value":
            raise _Failed(f"{func.id} {kind}: {value}")
        return value


@lru_cache(maxsize=4)
def sandbox_for(limits: SandboxLimits, concurrency: int) -> Sandbox:
    """One sandbox (and so one concurrency limit) per process and setting."""
    return Sandbox(limits, concurrency)


def tests_of(ground_truth, extra_info: dict | None) -> list[str]:
    tests = (extra_info or {}).get("tests") or ground_truth
    if isinstance(tests, str) and len(tests) > MAX_TESTS * MAX_TEST_CHARS:
        raise ValueError(f"code reward: a ground truth of {len(tests)} characters; too long to be tests")
    tests = json.loads(tests) if isinstance(tests, str) else tests
    if isinstance(tests, list) and len(tests) > MAX_TESTS:
        raise ValueError(f"code reward: {len(tests)} tests in one row; at most {MAX_TESTS}")
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise ValueError(
            "code reward: ground_truth (or extra_info['tests']) must be a JSON list of test "
            f'statements such as ["assert f(1) == 2"], got {str(ground_truth)[:80]!r}'
        )
    return tests


def run_tests(code: str, tests: list[str], sandbox: Sandbox) -> tuple[list[bool], str]:
    """Which tests pass, and how the sandboxed run ended (its status)."""
    expressions = [parse_test(t) for t in tests]  # a malformed test is found before any code runs
    passed: list[bool] = []
    status = "ok"
    with sandbox.session(code) as session:
        evaluator = Evaluator(session.call)
        status = "ok" if session.loaded else "error"
        for expression in expressions:
            try:
                passed.append(bool(evaluator.evaluate(expression)))
            except _Failed:
                passed.append(False)
            except SessionClosed as closed:
                status = closed.status
                break
            except Unsupported:
                raise
            except Exception:  # the host's own evaluation failed (a TypeError comparing values): not passed
                passed.append(False)
    ended = session.result.status if session.result is not None else "ok"
    if ended not in ("ok", "error"):  # a limit of the tree was reached: that is how it ended
        status = ended
    if status not in ("ok", "error"):  # a run that did not end by itself passes nothing, whatever it answered
        return [False] * len(tests), status
    return passed, status


def score(
    response_text: str,
    ground_truth,
    extra_info: dict | None = None,
    *,
    limits: SandboxLimits = SandboxLimits(),
    concurrency: int = 2,
) -> dict[str, float]:
    """{"score": fraction of tests passed, "passed": count, "status/<s>": 1.0 for how the run ended, else 0}."""
    tests = tests_of(ground_truth, extra_info)
    passed, status = run_tests(extract_code(response_text), tests, sandbox_for(limits, concurrency))
    return {
        "score": sum(passed) / max(len(tests), 1),
        "passed": float(sum(passed)),
        **{f"status/{s}": float(s == status) for s in STATUSES},
    }


def truth_problem(ground_truth, extra_info: dict | None = None) -> str | None:
    """Why a row's tests can never be run (not a list of tests, too many, too long, not one assert over what
    the evaluator takes), or None: the reason its row is quarantined at cleaning, not a failed run later."""
    try:
        for test in tests_of(ground_truth, extra_info):
            parse_test(test)
    except json.JSONDecodeError as exc:
        return f"is not a JSON list of tests ({exc.msg})"
    except ValueError as exc:
        return f"is not runnable: {str(exc).removeprefix('code reward: ')[:300]}"
    return None
