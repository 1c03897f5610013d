"""Code scorer: the response's Python, run against the sample's tests in the bubblewrap sandbox.

ground_truth (or extra_info["tests"]) is a JSON list of test statements, e.g. `["assert add(1, 2) == 3"]`.
The solution runs first, then each test in the solution's namespace; score = fraction of tests that pass.
A solution that times out, exhausts memory or floods its output scores 0, with the status as a sub-score.
"""

from __future__ import annotations

import json
import re
import secrets
from functools import lru_cache

from components.rewards.sandbox import Sandbox, SandboxLimits

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "no_result")
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)

HARNESS = """\
import json as __json
__tests = __json.loads({tests!r})
__ns = {{"__name__": "__main__"}}
try:
    exec(compile({code!r}, "<solution>", "exec"), __ns)
except MemoryError:
    raise
except BaseException as __exc:
    print("solution failed:", type(__exc).__name__, __exc)
__passed = []
for __t in __tests:
    try:
        exec(compile(__t, "<test>", "exec"), __ns)
        __passed.append(True)
    except MemoryError:
        raise
    except BaseException:
        __passed.append(False)
print({marker!r} + __json.dumps(__passed), flush=True)
"""


def extract_code(text: str) -> str:
    """The last fenced code block of the response, or the whole response when it has none.

    >>> extract_code("Here:\\n```python\\nx = 1\\n```\\ndone")
    'x = 1\\n'
    >>> extract_code("y = 2")
    'y = 2'
    """
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


@lru_cache(maxsize=4)
def sandbox_for(limits: SandboxLimits, concurrency: int) -> Sandbox:
    """One sandbox (and so one concurrency limit) per process and setting."""
    return Sandbox(limits, concurrency)


def tests_of(ground_truth, extra_info: dict | None) -> list[str]:
    tests = (extra_info or {}).get("tests") or ground_truth
    tests = json.loads(tests) if isinstance(tests, str) else tests
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise ValueError("code reward: ground_truth (or extra_info['tests']) must be a JSON list of test "
                         f"statements such as [\"assert f(1) == 2\"], got {str(ground_truth)[:80]!r}")
    return tests


def run_tests(code: str, tests: list[str], sandbox: Sandbox) -> tuple[list[bool], str]:
    """Which tests pass, and how the sandboxed run ended (its status)."""
    marker = f"__result_{secrets.token_hex(8)}__"
    result = sandbox.run(HARNESS.format(tests=json.dumps(tests), code=code, marker=marker))
    lines = [line for line in result.stdout.splitlines() if line.startswith(marker)]
    if result.status != "ok" or not lines:
        return [False] * len(tests), result.status if result.status != "ok" else "no_result"
    return [bool(x) for x in json.loads(lines[-1][len(marker):])], "ok"


def score(response_text: str, ground_truth, extra_info: dict | None = None, *,
          limits: SandboxLimits = SandboxLimits(), concurrency: int = 2) -> dict[str, float]:
    """{"score": fraction of tests passed, "passed": count, "status/<s>": 1.0 for how the run ended, else 0}."""
    tests = tests_of(ground_truth, extra_info)
    passed, status = run_tests(extract_code(response_text), tests, sandbox_for(limits, concurrency))
    return {"score": sum(passed) / max(len(tests), 1), "passed": float(sum(passed)),
            **{f"status/{s}": float(s == status) for s in STATUSES}}
