"""The tool-calling environment: each assistant turn that ends in a tool call gets the tool's output as a
`tool` message; a turn without one (or the last turn) ends the episode, scored by the row's data_source."""

from __future__ import annotations

from components.envs.base import Step, register
from components.rollout.tools import ToolError, parse_tool_call


class ToolEnv:
    """One episode of tool calls. A malformed call is answered with its error, so the model can fix it; a call
    in the last turn is not run."""

    def __init__(self, tools: dict):
        self.tools = tools

    def reset(self, row: dict, seed: int) -> None:
        return None  # the row's prompt is the first message

    def step(self, text: str, last_turn: bool) -> Step:
        try:
            call = parse_tool_call(text)
        except ToolError as exc:
            errors = {"tool_errors": 1.0}
            return Step(counts=errors) if last_turn else Step(f"error: {exc}", counts=errors)
        if call is None or last_turn:
            return Step()
        name, arguments = call
        try:
            if name not in self.tools:
                raise ToolError(f"unknown tool {name!r}; tools: {', '.join(sorted(self.tools))}")
            return Step(self.tools[name](arguments), counts={"tool_calls": 1.0})
        except ToolError as exc:
            return Step(f"error: {exc}", counts={"tool_calls": 1.0, "tool_errors": 1.0})


@register("tools", counters=("tool_calls", "tool_errors"))
def tools_env(settings, tools: dict):
    """multi_turn.env=tools: the tools of multi_turn.tools, shared by every episode (they keep no state)."""
    return lambda: ToolEnv(tools)
