"""Tools a multi-turn rollout can call, hermes-style: the model writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the tool runs, and its output comes back as a tool
turn. Each tool is a small class with a JSON schema (what a chat template shows the model) and `__call__`.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from typing import Protocol

from components.algorithms.registry import Registry

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


class ToolError(Exception):
    """A bad call (malformed JSON, unknown tool, bad arguments) or a tool that failed: shown to the model."""


class Tool(Protocol):
    name: str
    schema: dict  # OpenAI-style function schema

    def __call__(self, arguments: dict) -> str: ...


def _function_schema(name: str, description: str, params: dict[str, str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": v} for k, v in params.items()},
                "required": list(params),
            },
        },
    }


TOOLS: Registry = Registry("tool", "multi_turn.tools")


@TOOLS.register("calculator")
class Calculator:
    """Exact arithmetic on integers with + - * / and parentheses (parsed, never `eval`ed).

    >>> Calculator()({"expression": "123*45 - 5"})
    '5530'
    >>> Calculator()({"expression": "7/2"})
    '3.5'
    """

    name = "calculator"
    schema = _function_schema(
        "calculator",
        "Evaluate an arithmetic expression exactly",
        {"expression": "integers with + - * / and parentheses, e.g. 123*45"},
    )

    def __call__(self, arguments: dict) -> str:
        from components.rewards.countdown import BadEquation, evaluate

        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ToolError('calculator needs {"expression": "<arithmetic>"}')
        try:
            value, _ = evaluate(expression)
        except BadEquation as exc:
            raise ToolError(f"calculator: {exc}") from None
        return _format_number(value)


def _format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


@TOOLS.register("python")
class PythonTool:
    """Runs the code in the bubblewrap sandbox (components/rewards/sandbox.py); returns what it printed."""

    name = "python"
    schema = _function_schema(
        "python",
        "Run Python code in a sandbox and return what it prints",
        {"code": "a Python program; print the result"},
    )

    def __init__(self, limits=None, concurrency: int = 2):
        from components.rewards.sandbox import Sandbox
        from components.settings import SandboxLimits

        self.sandbox = Sandbox(limits or SandboxLimits(), concurrency)

    def __call__(self, arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError('python needs {"code": "<program>"}')
        result = self.sandbox.run(code)
        if result.status != "ok":
            raise ToolError(f"python: {result.status}: {result.stderr.strip()[-300:]}")
        return result.stdout


def parse_tool_call(text: str) -> tuple[str, dict] | None:
    """The (name, arguments) of the last complete tool call in `text`; None when there is none.

    >>> parse_tool_call('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>')
    ('calculator', {'expression': '2+2'})
    >>> parse_tool_call("#### 4") is None
    True
    """
    found = _CALL.findall(text)
    if not found:
        return None
    try:
        call = json.loads(found[-1])
    except json.JSONDecodeError as exc:
        raise ToolError(f"tool call is not JSON: {exc.msg}") from None
    if (
        not isinstance(call, dict)
        or not isinstance(call.get("name"), str)
        or not isinstance(call.get("arguments", {}), dict)
    ):
        raise ToolError('a tool call is {"name": "<tool>", "arguments": {...}}')
    return call["name"], call.get("arguments", {})


def tool_call_text(name: str, arguments: dict) -> str:
    """The call as the model writes it (compact JSON), for SFT data."""
    return CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + CALL_CLOSE
