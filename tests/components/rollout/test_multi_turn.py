"""Multi-turn tool calling: call parsing, tools, the turn loop's masks, and training only on model tokens."""

from __future__ import annotations

import pytest
import torch

from components.batch import Batch
from components.envs.tools import ToolEnv
from components.rollout.base import RolloutOutput
from components.rollout.multi_turn import play_episodes, tool_turn_text
from components.rollout.tools import Calculator, ToolError, parse_tool_call, tool_call_text
from components.settings import SamplingParams
from components.training.logprobs import batch_logprobs, response_logprobs
from components.training.sft import collate, encode_examples


@pytest.fixture
def tokenizer():
    """The character tokenizer with the tool-call markers as single tokens (as multi-turn runs build it)."""
    from components.models import build_char_tokenizer

    return build_char_tokenizer(tool_tokens=True)


def test_parse_tool_call():
    call = tool_call_text("calculator", {"expression": "12*34"})
    assert call == '<tool_call>{"name":"calculator","arguments":{"expression":"12*34"}}</tool_call>'
    assert parse_tool_call("think " + call) == ("calculator", {"expression": "12*34"})
    assert parse_tool_call("#### 408") is None
    assert parse_tool_call('<tool_call>{"name": "calculator"') is None  # never closed: not a call
    with pytest.raises(ToolError, match="not JSON"):
        parse_tool_call("<tool_call>{name: calculator}</tool_call>")
    with pytest.raises(ToolError, match="a tool call is"):
        parse_tool_call('<tool_call>["calculator"]</tool_call>')


def test_calculator():
    calc = Calculator()
    assert calc({"expression": "12*34"}) == "408" and calc({"expression": "(1+2)/4"}) == "0.75"
    for bad in ({"expression": "__import__('os')"}, {"expression": "1/0"}, {}):
        with pytest.raises(ToolError):
            calc(bad)


class ScriptedEngine:
    """A stand-in for an engine with fixed replies per turn (the loop's bookkeeping is what is tested; the real
    engine's sampling is tested in test_hf_engine.py and end to end in tests/flows/test_multi_turn_flow.py)."""

    def __init__(self, tokenizer, replies: list[list[str]]):
        self.tokenizer, self.replies, self.turn, self.weights_version = tokenizer, replies, 0, 3
        self.seen: list[list[list[int]]] = []

    def generate(self, prompts, params: SamplingParams, seed: int) -> RolloutOutput:
        self.seen.append([list(p) for p in prompts])
        texts = self.replies[self.turn]
        self.turn += 1
        stop = {self.tokenizer.eos_token_id, *params.stop_token_ids}
        rows = []
        for text in texts:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            rows.append(ids if ids and ids[-1] in stop else ids + [self.tokenizer.eos_token_id])
        width = max(len(r) for r in rows)
        out = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        return RolloutOutput(out, mask, -0.5 * mask.float(), self.weights_version)


def test_turn_loop_masks_tool_output_and_counts(tokenizer):
    call = tool_call_text("calculator", {"expression": "6*7"})
    engine = ScriptedEngine(
        tokenizer,
        [
            [
                call,
                "#### 5",
                '<tool_call>{"name":"nope","arguments":{}}</tool_call>',
                "<tool_call>{bad}</tool_call>",
            ],
            ["#### 42", "x", "y"],  # turn 2 only for the three rows that called (or tried to call) a tool
        ],
    )
    prompts = [tokenizer("6*7=", add_special_tokens=False)["input_ids"]]
    envs = [ToolEnv({"calculator": Calculator()}) for _ in range(4)]
    mt = play_episodes(
        engine, tokenizer, prompts, SamplingParams(n=4, max_new_tokens=64), 0, envs, max_turns=2
    )
    out = mt.out
    assert mt.num_turns.tolist() == [2, 1, 2, 2] and mt.tool_calls.tolist() == [1, 0, 1, 0]
    assert mt.tool_errors.tolist() == [0, 0, 1, 1] and out.weights_version == 3
    row = out.responses[0][mt.attention_mask[0].bool()].tolist()
    tool = tokenizer(tool_turn_text(tokenizer, "42", False), add_special_tokens=False)["input_ids"]
    call_ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    answer = tokenizer("#### 42", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert row == call_ids + tool + answer
    # trained on: the model's tokens only; log-probs sit on them and are 0 on the tool turn
    assert out.response_mask[0, : len(row)].tolist() == [1] * len(call_ids) + [0] * len(tool) + [1] * len(
        answer
    )
    assert torch.equal(out.logprobs[0] == 0, out.response_mask[0] == 0)
    # turn 2 continued from prompt + turn 1 + the tool's output
    assert engine.seen[1][0] == prompts[0] + call_ids + tool
    assert "unknown tool 'nope'" in tokenizer.decode(engine.seen[1][1])
    assert "not JSON" in tokenizer.decode(engine.seen[1][2])


def test_a_call_in_the_last_turn_is_not_run(tokenizer):
    call = tool_call_text("calculator", {"expression": "1+1"})
    engine = ScriptedEngine(tokenizer, [[call]])
    envs = [ToolEnv({"calculator": Calculator()})]
    mt = play_episodes(engine, tokenizer, [[5]], SamplingParams(n=1), 0, envs, max_turns=1)
    assert mt.tool_calls.tolist() == [0] and torch.equal(mt.attention_mask, mt.out.response_mask)


def test_later_tokens_attend_to_the_tool_turn(tokenizer):
    """Log-probs with response_attention_mask equal a plain forward over the whole sequence."""
    from tests.conftest import make_model

    torch.manual_seed(0)
    model = make_model(tokenizer).eval()
    prompts, prompt_mask = torch.randint(5, 90, (2, 4)), torch.ones(2, 4, dtype=torch.long)
    responses = torch.randint(5, 90, (2, 9))
    attention = torch.ones(2, 9, dtype=torch.long)
    loss_mask = attention.clone()
    loss_mask[:, 3:6] = 0  # a tool turn in the middle
    batch = Batch(
        {
            "prompts": prompts,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": loss_mask,
            "response_attention_mask": attention,
        }
    )
    full, _ = response_logprobs(model, prompts, prompt_mask, responses, attention)
    torch.testing.assert_close(batch_logprobs(model, batch, 1.0, None), full)
    without, _ = response_logprobs(model, prompts, prompt_mask, responses, loss_mask)
    assert not torch.allclose(without[:, 6:], full[:, 6:])  # masking the tool turn would change them


def test_sft_masks_tool_output(tokenizer):
    answer = tool_call_text("calculator", {"expression": "2*3"}) + "<tool_response>6</tool_response>#### 6"
    (ex,) = encode_examples(tokenizer, [[{"role": "user", "content": "2*3="}]], [answer])
    labels = collate([ex], tokenizer.pad_token_id)["labels"][0]
    targets = tokenizer.decode([t for t in labels.tolist() if t != -100])
    assert (
        targets == answer.replace("<tool_response>6</tool_response>", "") + "<eos>"
        and ex.answer_mask.count(0) == 3
    )


def test_an_episode_splits_into_its_turns():
    from components.rollout.multi_turn import episode_turns

    model = torch.tensor([1, 1, 0, 0, 1, 0, 0])  # the model's call, the tool's result, the answer, padding
    attention = torch.tensor([1, 1, 1, 1, 1, 0, 0])
    assert episode_turns(model, attention) == [("assistant", 0, 2), ("tool", 2, 4), ("assistant", 4, 5)]
    assert episode_turns(torch.zeros(3), torch.zeros(3)) == []
