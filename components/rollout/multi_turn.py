"""Multi-turn rollouts: each sample is an episode of an environment (components/envs). Generate a turn, give
it to the environment, append its observation (a tool's output, a game's next move) as a message of its role,
generate again, up to `max_turns` assistant turns per sample. Tool calling is the `tools` environment.

Only model-generated tokens are trained on: the returned `response_mask` is 1 on them and 0 on observation
turns, while `attention_mask` (1 on every response token) is what the model sees in later forward passes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from components.data import templates
from components.envs.base import Environment, Step, bounded, checked_reward
from components.errors import RewardError
from components.rollout.base import RolloutOutput
from components.rollout.tools import CALL_CLOSE, TOOLS
from components.seeding import derive_seed
from components.settings import SamplingParams

log = logging.getLogger(__name__)
_MARK = "\u2063ASSISTANT\u2063"  # a placeholder no real answer contains


@dataclass
class MultiTurnOutput:
    """out: responses (N, R) with observation turns inside, response_mask (N, R) 1 on model tokens only,
    logprobs (N, R); attention_mask (N, R) 1 on every response token; num_turns (N,); counts: name -> (N,) the
    environments' counters summed per episode; rewards (N,) the environments' rewards, NaN where an episode
    has none (its data_source scorer scores it)."""

    out: RolloutOutput
    attention_mask: torch.Tensor
    num_turns: torch.Tensor
    counts: dict[str, torch.Tensor]
    rewards: torch.Tensor

    @property
    def tool_calls(self) -> torch.Tensor:
        return self.counts.get("tool_calls", torch.zeros_like(self.num_turns))

    @property
    def tool_errors(self) -> torch.Tensor:
        return self.counts.get("tool_errors", torch.zeros_like(self.num_turns))


def make_tools(names: list[str], sandbox_limits=None, concurrency: int = 2) -> dict:
    """name -> tool instance; the python tool gets the sandbox limits."""
    tools = {}
    for name in names:
        cls = TOOLS.get(name)
        tools[name] = cls(sandbox_limits, concurrency) if name == "python" else cls()
    return tools


def tool_turn_text(tokenizer, result: str, after_eos: bool, role: str = "tool") -> str:
    """The text the chat template puts between the end of an assistant turn and the next assistant turn, with
    an observation as a message of `role` (a tool's output, Qwen2.5: `<|im_end|>\\n<|im_start|>user\\n
    <tool_response>...`; a game's next move, `user`). When the assistant turn already ended with EOS, a leading
    EOS in that text is not repeated."""
    return turns_after_reply(tokenizer, [{"role": role, "content": result}], after_eos)


def observation_text(tokenizer, step: Step, max_chars: int, after_eos: bool) -> str:
    """A step's observation as the text after the reply: one message of step.role, or the messages it gives
    (an agent's new messages), each content cut to max_chars."""
    if isinstance(step.observation, str):
        return tool_turn_text(tokenizer, step.observation[:max_chars], after_eos, step.role)
    cut = [{**m, "content": str(m.get("content") or "")[:max_chars]} for m in step.observation]
    return turns_after_reply(tokenizer, cut, after_eos)


def turns_after_reply(tokenizer, messages: list[dict], after_eos: bool) -> str:
    """The text from the end of an assistant reply to the next generation prompt, with `messages` (tool
    results, a user's replies) between: what a conversation appends after a reply, without rendering the
    reply again."""
    user = [{"role": "user", "content": "q"}]
    before = templates.render(tokenizer, user, add_generation_prompt=True)
    full = templates.render(
        tokenizer, user + [{"role": "assistant", "content": _MARK}, *messages], add_generation_prompt=True
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


def conversation_ids(
    tokenizer, messages: list[dict], settings, max_obs_chars: int | None = None
) -> list[int]:
    """The token ids a multi-turn rollout holds after `messages`: the messages before the first assistant
    turn as its prompt, then each assistant reply's tokens with the EOS that ended it, and the messages that
    answered it (each cut to max_obs_chars) as play_episodes appends them. SFT on a game's conversations
    trains on exactly the contexts the rollout will give (a template that renders no end of an assistant turn,
    as the tiny model's, would otherwise leave out the EOS the rollout keeps). settings: PromptSettings."""
    from components.data.prompts import encode_prompt

    first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    ids = encode_prompt(tokenizer, messages[:first], settings)
    after: list[dict] = []
    for message in [*messages[first:], None]:  # None: the end, which flushes the last answers
        if message is not None and message["role"] != "assistant":
            after.append(message)
            continue
        if after:  # the answers as the rollout appends an environment's messages
            text = observation_text(tokenizer, Step(observation=after), max_obs_chars, True)
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
            after = []
        if message is not None:
            ids += tokenizer(message["content"], add_special_tokens=False)["input_ids"]
            ids.append(tokenizer.eos_token_id)
    return ids


def single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def episode_names(env_name: str | Sequence[str], count: int) -> list[str]:
    """Each episode's environment name: one for all, or one per episode (a mixture, multi_turn.envs)."""
    return [env_name] * count if isinstance(env_name, str) else list(env_name)


def first_messages(
    rows: list[dict],
    envs: list[Environment],
    n: int,
    seed: int,
    env_name: str | Sequence[str] = "tools",
    timeout_s: float = 60.0,
) -> list[dict]:
    """The rows with each one's prompt replaced by the first messages its episodes' environments give on reset
    (envs[i*n + j] plays sample j of row i; all n get the row and the group's seed, so they start alike). A
    reset that raises or hangs past timeout_s is a RewardError naming the environment and the episode.
    env_name: the environments' name, or each episode's."""
    names, out = episode_names(env_name, len(envs)), []
    for i, row in enumerate(rows):
        group_seed = derive_seed(seed, "episode", i)
        given = [
            bounded(
                envs[i * n + j].reset,
                (row, group_seed),
                timeout_s,
                f"environment {names[i * n + j]}, episode {i * n + j}: reset",
            )
            for j in range(n)
        ]
        out.append(row if given[0] is None else {**row, "prompt": given[0]})
    return out


def play_episodes(
    engine,
    tokenizer,
    prompts: list[list[int]],
    params: SamplingParams,
    seed: int,
    envs: list[Environment],
    max_turns: int,
    max_obs_chars: int = 256,
    env_name: str | Sequence[str] = "tools",
    step_timeout_s: float = 60.0,
    max_context: int = 4096,
) -> MultiTurnOutput:
    """params.n samples per prompt (row i*n + j is sample j of prompt i, played by envs[i*n + j]), each up to
    max_turns assistant turns of at most params.max_new_tokens tokens. A turn stops at EOS, or at
    `</tool_call>` when that is one token; the environment's observation, cut to max_obs_chars, is appended
    as a turn of its role. The episode ends when the environment says so or the turns run out. A step that
    raises or takes longer than step_timeout_s is a RewardError naming the environment, episode and turn.
    Each turn fits max_context (actor.model.max_seq_len): first messages that leave no room for a reply are a
    RewardError; an observation that would leave none ends its episode (a warning, counted as `context_full`)."""
    names = episode_names(env_name, len(envs))
    eos = tokenizer.eos_token_id
    close = single_token(tokenizer, CALL_CLOSE)
    turn_params = replace(params, n=1, stop_token_ids=(close,) if close is not None else ())
    contexts = [list(p) for p in prompts for _ in range(params.n)]
    n_rows = len(contexts)
    for i, context in enumerate(contexts):  # an opening that leaves no room for a reply is the config's error
        if len(context) + params.max_new_tokens > max_context:
            raise RewardError(
                f"environment {names[i]}, episode {i}: its first messages are {len(context)} tokens, and with "
                f"engine.max_new_tokens={params.max_new_tokens} they pass actor.model.max_seq_len={max_context}; "
                "raise actor.model.max_seq_len or shorten the environment's opening"
            )
    tokens: list[list[int]] = [[] for _ in range(n_rows)]
    loss: list[list[int]] = [[] for _ in range(n_rows)]
    logps: list[list[float]] = [[] for _ in range(n_rows)]
    turns = [0] * n_rows
    counts: dict[str, list[float]] = {}
    rewards = [float("nan")] * n_rows
    active, version = list(range(n_rows)), engine.weights_version
    full: list[tuple[int, int, int]] = []  # (episode, turn, observation tokens) of episodes the context ended
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
            text, last = tokenizer.decode(new, skip_special_tokens=False), turn == max_turns - 1
            # the environment's bug (a raise, a hang) is not the run's: one line naming where
            step = bounded(
                envs[i].step,
                (text, last),
                step_timeout_s,
                f"environment {names[i]}, episode {i}, turn {turn + 1}: step",
            )
            for name, value in step.counts.items():
                counts.setdefault(name, [0.0] * n_rows)[i] += value
            reward = checked_reward(names[i], i, step.reward)
            if reward is not None:
                rewards[i] = reward
            if step.ends or turn == max_turns - 1:
                continue
            delta = tokenizer(
                observation_text(tokenizer, step, max_obs_chars, bool(new) and new[-1] == eos),
                add_special_tokens=False,
            )["input_ids"]
            if len(contexts[i]) + len(delta) + params.max_new_tokens > max_context:
                # the observation leaves no room for the next reply: the episode ends before it, counted
                full.append((i, turn + 1, len(delta)))
                counts.setdefault("context_full", [0.0] * n_rows)[i] += 1
                getattr(envs[i], "close", lambda: None)()  # an agent waiting on its request is let go
                continue
            tokens[i] += delta
            loss[i] += [0] * len(delta)
            logps[i] += [0.0] * len(delta)
            contexts[i] += delta
            still.append(i)
        active = still
    if full:
        (i, turn, size), more = full[0], len(full) - 1
        log.warning(
            "environment %s, episode %d, turn %d: its observation (%d tokens) would pass "
            "actor.model.max_seq_len=%d; the episode ends there%s",
            names[i],
            i,
            turn,
            size,
            max_context,
            f" ({more} more episodes alike)" if more else "",
        )
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
        {name: torch.tensor(values, dtype=torch.float32) for name, values in counts.items()},
        torch.tensor(rewards, dtype=torch.float32),
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
