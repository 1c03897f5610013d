"""Multi-turn rollouts with tool calls: generate, run the called tool, append its output as a tool turn,
generate again, up to `max_turns` assistant turns per sample.

Only model-generated tokens are trained on: the returned `response_mask` is 1 on them and 0 on tool turns,
while `attention_mask` (1 on every response token) is what the model sees in later forward passes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from components.data import templates
from components.rollout.base import RolloutOutput
from components.rollout.tools import CALL_CLOSE, TOOLS, ToolError, parse_tool_call
from components.seeding import derive_seed
from components.settings import SamplingParams

_MARK = "\u2063ASSISTANT\u2063"  # a placeholder no real answer contains


@dataclass
class MultiTurnOutput:
    """out: responses (N, R) with tool turns inside, response_mask (N, R) 1 on model tokens only, logprobs (N, R);
    attention_mask (N, R) 1 on every response token; num_turns, tool_calls, tool_errors (N,) per sample."""

    out: RolloutOutput
    attention_mask: torch.Tensor
    num_turns: torch.Tensor
    tool_calls: torch.Tensor
    tool_errors: torch.Tensor


def make_tools(names: list[str], sandbox_limits=None, concurrency: int = 2) -> dict:
    """name -> tool instance; the python tool gets the sandbox limits."""
    tools = {}
    for name in names:
        cls = TOOLS.get(name)
        tools[name] = cls(sandbox_limits, concurrency) if name == "python" else cls()
    return tools


def tool_turn_text(tokenizer, result: str, after_eos: bool) -> str:
    """The text the chat template puts between the end of an assistant turn and the next assistant turn, with
    the tool's output as a `tool` message (Qwen2.5: `<|im_end|>\\n<|im_start|>user\\n<tool_response>...`). When
    the assistant turn already ended with EOS, a leading EOS in that text is not repeated."""
    user = [{"role": "user", "content": "q"}]
    before = templates.render(tokenizer, user, add_generation_prompt=True)
    full = templates.render(
        tokenizer,
        user + [{"role": "assistant", "content": _MARK}, {"role": "tool", "content": result}],
        add_generation_prompt=True,
    )
    if not full.startswith(before + _MARK):
        raise ValueError(
            "the tokenizer's chat template does not render an assistant turn after the generation "
            "prompt verbatim, so tool turns cannot be appended; use a model whose template supports "
            "the `tool` role"
        )
    text = full[len(before) + len(_MARK) :]
    eos = tokenizer.eos_token or ""
    return text[len(eos) :] if after_eos and eos and text.startswith(eos) else text


def single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def multi_turn_generate(
    engine,
    tokenizer,
    prompts: list[list[int]],
    params: SamplingParams,
    seed: int,
    tools: dict,
    max_turns: int,
    max_tool_chars: int = 256,
) -> MultiTurnOutput:
    """params.n samples per prompt (row i*n + j is sample j of prompt i), each up to max_turns assistant turns
    of at most params.max_new_tokens tokens. A turn that ends in a tool call (`</tool_call>` stops a turn
    when it is one token) runs the tool; its output (or the error, counted in tool_errors) is cut to
    max_tool_chars and appended as a tool turn. A call in the last turn is not run."""
    eos = tokenizer.eos_token_id
    close = single_token(tokenizer, CALL_CLOSE)
    turn_params = replace(params, n=1, stop_token_ids=(close,) if close is not None else ())
    contexts = [list(p) for p in prompts for _ in range(params.n)]
    n_rows = len(contexts)
    tokens: list[list[int]] = [[] for _ in range(n_rows)]
    loss: list[list[int]] = [[] for _ in range(n_rows)]
    logps: list[list[float]] = [[] for _ in range(n_rows)]
    turns, calls, errors = [0] * n_rows, [0] * n_rows, [0] * n_rows
    active, version = list(range(n_rows)), engine.weights_version
    for turn in range(max_turns):
        if not active:
            break
        out = engine.generate([contexts[i] for i in active], turn_params, derive_seed(seed, "turn", turn))
        version = out.weights_version
        still = []
        for j, i in enumerate(active):
            keep = out.response_mask[j].bool()
            new = out.responses[j][keep].tolist()
            tokens[i] += new
            loss[i] += [1] * len(new)
            logps[i] += out.logprobs[j][keep].tolist()
            contexts[i] += new
            turns[i] += 1
            try:
                call = parse_tool_call(tokenizer.decode(new, skip_special_tokens=False))
            except ToolError as exc:
                call, result = None, f"error: {exc}"
                errors[i] += 1
                if turn < max_turns - 1:  # a malformed call is answered with the error, so it can be fixed
                    call = ("", {})
            if call is None or turn == max_turns - 1:
                continue
            name, arguments = call
            if name:
                calls[i] += 1
                try:
                    if name not in tools:
                        raise ToolError(f"unknown tool {name!r}; tools: {', '.join(sorted(tools))}")
                    result = tools[name](arguments)
                except ToolError as exc:
                    result = f"error: {exc}"
                    errors[i] += 1
            delta = tokenizer(
                tool_turn_text(tokenizer, result[:max_tool_chars], bool(new) and new[-1] == eos),
                add_special_tokens=False,
            )["input_ids"]
            tokens[i] += delta
            loss[i] += [0] * len(delta)
            logps[i] += [0.0] * len(delta)
            contexts[i] += delta
            still.append(i)
        active = still
    width = max(1, max(len(t) for t in tokens))
    responses = torch.full((n_rows, width), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((n_rows, width), dtype=torch.long)
    attention = torch.zeros((n_rows, width), dtype=torch.long)
    logprobs = torch.zeros((n_rows, width))
    for i in range(n_rows):
        k = len(tokens[i])
        responses[i, :k] = torch.tensor(tokens[i], dtype=torch.long)
        response_mask[i, :k] = torch.tensor(loss[i], dtype=torch.long)
        attention[i, :k] = 1
        logprobs[i, :k] = torch.tensor(logps[i])
    return MultiTurnOutput(
        RolloutOutput(responses, response_mask, logprobs, version),
        attention,
        torch.tensor(turns, dtype=torch.float32),
        torch.tensor(calls, dtype=torch.float32),
        torch.tensor(errors, dtype=torch.float32),
    )


def episode_turns(model_mask: torch.Tensor, attention: torch.Tensor) -> list[tuple[str, int, int]]:
    """One sampled episode's turns in order, as (role, start, end) spans of its response tokens: "assistant"
    for a run of model tokens (model_mask 1), "tool" for a run of tool-turn tokens between them (attention 1,
    model_mask 0); padding (attention 0) ends the episode. model_mask, attention: (R,)."""
    turns: list[tuple[str, int, int]] = []
    for t in range(int(attention.sum())):
        role = "assistant" if int(model_mask[t]) else "tool"
        if turns and turns[-1][0] == role:
            turns[-1] = (role, turns[-1][1], t + 1)
        else:
            turns.append((role, t, t + 1))
    return turns
