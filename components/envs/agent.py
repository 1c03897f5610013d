"""Black-box agents: an OpenAI-compatible `/v1/chat/completions` endpoint over the rollout engine, one base URL
per episode (`http://127.0.0.1:<port>/episodes/<id>/v1`), so any agent program that uses the `openai` client
runs episodes against the policy.

Token in, token out: an episode's first request is rendered through the chat template and tokenized; every
later one must repeat the conversation so far (the assistant replies exactly as returned) and only its new
messages are rendered and tokenized, appended to the ids the episode already holds, so no sampled token is
ever tokenized again. Each completion's token ids and log-probs are recorded; `episode()` gives the episode
as the multi-turn rollout lays one out: prompt ids, then response ids with the model's tokens in the loss mask
and the agent's messages (tool results, a user's replies) masked out.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from components.data import templates
from components.envs.base import Step, register
from components.errors import RewardError
from components.rewards.custom import CustomReward, UserCode, load_custom_reward

if TYPE_CHECKING:
    from components.settings import SamplingParams


@dataclass
class Episode:
    """One agent episode: the prompt ids of its first request, then every token after it, with the loss mask
    (1 on sampled tokens) and their log-probs (0 on the agent's messages)."""

    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    loss: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the conversation so far, the replies as returned
    calls: int = 0
    ended_with_eos: bool = False


class AgentServer:
    """The endpoint, served in threads of this process while `with` holds it; the engine samples one request
    at a time (its own lock)."""

    def __init__(self, engine, tokenizer, params: SamplingParams, seed: int):
        self.engine, self.tokenizer, self.params, self.seed = engine, tokenizer, params, seed
        self.episodes: dict[str, Episode] = {}
        self.lock = threading.Lock()
        self.http = serve_chat_completions(self.complete)
        self.thread = threading.Thread(target=self.http.serve_forever, name="agent-endpoint", daemon=True)

    def __enter__(self) -> AgentServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()

    def base_url(self, episode: str) -> str:
        """What an agent gives the `openai` client as base_url for episode `episode`."""
        self.episodes.setdefault(episode, Episode())
        return f"http://127.0.0.1:{self.http.server_address[1]}/episodes/{episode}/v1"

    def complete(self, episode_id: str, body: dict) -> dict:
        """One chat completion of the episode: its new messages appended, a reply sampled and recorded."""
        if episode_id not in self.episodes:
            raise ValueError(f"episode {episode_id!r} was not started by this rollout")
        ep, messages = self.episodes[episode_id], body["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: a non-empty list of {role, content} is required")
        budget = self.params.max_new_tokens  # an agent may ask for fewer tokens, never more
        asked = int(body.get("max_tokens") or body.get("max_completion_tokens") or budget)
        params = replace(
            self.params,
            n=1,
            max_new_tokens=max(1, min(asked, budget)),
            temperature=float(body.get("temperature", self.params.temperature)),
        )
        from components.seeding import derive_seed

        with self.lock:
            context = self._context(ep, messages)
            out = self.engine.generate(
                [context], params, derive_seed(self.seed, "agent", episode_id, ep.calls)
            )
        keep = out.response_mask[0].bool()
        new, logps = out.responses[0][keep].tolist(), out.logprobs[0][keep].tolist()
        ep.tokens += new
        ep.loss += [1] * len(new)
        ep.logprobs += logps
        ep.calls += 1
        eos = self.tokenizer.eos_token_id
        ep.ended_with_eos = bool(new) and new[-1] == eos
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        ep.messages = [*messages, {"role": "assistant", "content": text}]
        return completion(text, ep.ended_with_eos, body, len(context), len(new))

    def _context(self, ep: Episode, messages: list[dict]) -> list[int]:
        """The ids the next reply continues: the first request rendered whole; a later one's new messages only,
        after the ids the episode holds (ValueError when it does not repeat the conversation so far)."""
        if ep.calls == 0:
            text = templates.render(self.tokenizer, messages, add_generation_prompt=True)
            ep.prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return list(ep.prompt)
        from components.rollout.multi_turn import turns_after_reply

        text = turns_after_reply(self.tokenizer, new_messages(ep.messages, messages), ep.ended_with_eos)
        delta = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ep.tokens += delta
        ep.loss += [0] * len(delta)
        ep.logprobs += [0.0] * len(delta)
        return ep.prompt + ep.tokens

    def episode(self, episode_id: str) -> Episode:
        ep = self.episodes.get(episode_id)
        if ep is None or ep.calls == 0:
            raise RewardError(f"agent episode {episode_id}: the agent made no chat completion request")
        return ep


def new_messages(history: list[dict], messages: list[dict]) -> list[dict]:
    """The messages a request adds after `history` (the conversation so far, each reply as returned); a
    ValueError when it does not repeat that history (token in, token out: it is never tokenized again)."""
    if messages[: len(history)] != history:
        raise ValueError(
            "messages must repeat the conversation so far, each reply as it was returned (token in, token "
            "out: the episode's tokens are never tokenized again)"
        )
    return messages[len(history) :]


def serve_chat_completions(complete) -> ThreadingHTTPServer:
    """An HTTP server on a free local port (not yet serving) that answers POST
    /episodes/<id>/v1/chat/completions with complete(id, body): 404 for another path, 400 with the error's
    message for a request complete() refuses (ValueError, KeyError, TypeError)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802  (http.server's name)
            parts = self.path.strip("/").split("/")
            if len(parts) != 5 or parts[0] != "episodes" or parts[2:] != ["v1", "chat", "completions"]:
                return self._answer(404, {"error": {"message": f"no such endpoint {self.path}"}})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                return self._answer(200, complete(parts[1], body))
            except (ValueError, KeyError, TypeError) as exc:
                return self._answer(400, {"error": {"message": str(exc), "type": "invalid_request_error"}})

        def _answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # one line per request on stderr is noise in a rollout
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def completion(text: str, ended: bool, body: dict, prompt_tokens: int, completion_tokens: int) -> dict:
    """A chat.completion object with one choice: `text`, finished by EOS (`ended`) or by the length limit."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "policy"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop" if ended else "length",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


# multi_turn.agent: file.py:function, called as function(base_url, row, seed) -> reward (or None)
AGENT = UserCode(
    "multi_turn.agent",
    "multi_turn.agent",
    '["http://127.0.0.1:1/episodes/e/v1", {}, 0]',
    "(base_url, row, seed)",
    "agent",
)


def load_agent(spec: str) -> CustomReward:
    """The agent program of multi_turn.agent (`file.py:function`), checked as a custom reward module is: a
    file inside the project, imported first in a process of its own (no exit, hang or thread at import), its
    function taking (base_url, row, seed). Imported for real on its first episode, in the rollout's process."""
    path, name = spec.split(":")
    return load_custom_reward(path, name, AGENT)


def check_agent(cfg) -> None:
    """At config validation: multi_turn.agent, when set, is such a program (ConfigError or RewardError)."""
    if cfg.multi_turn.enable and cfg.multi_turn.agent:
        load_agent(cfg.multi_turn.agent)


class AgentHub:
    """The endpoint of this process's agent episodes: each request is handed to its episode, which answers it
    with the policy's next reply, sampled by the rollout with the other episodes' turns."""

    def __init__(self):
        self.episodes: dict[str, AgentEpisode] = {}
        self.http = serve_chat_completions(self.complete)
        threading.Thread(target=self.http.serve_forever, name="agent-hub", daemon=True).start()

    def base_url(self, episode_id: str) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}/episodes/{episode_id}/v1"

    def complete(self, episode_id: str, body: dict) -> dict:
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise ValueError(f"episode {episode_id!r} is not one the rollout is playing")
        return episode.ask(body)


_hub: AgentHub | None = None
_hub_lock = threading.Lock()


def agent_hub() -> AgentHub:
    global _hub
    with _hub_lock:
        if _hub is None:
            _hub = AgentHub()
        return _hub


class AgentEpisode:
    """One episode of multi_turn.env=agent: the agent program runs in a thread of its own and drives it. Its
    first request's messages are the episode's first messages (reset); each later request gets the policy's
    reply to the one before (step), and its new messages (tool results, a user's turn) are the observation,
    rendered after the sampled reply's tokens, which are never tokenized again. The program's return value
    is the episode's reward. A request after the episode's last turn is answered with an empty reply
    (finish_reason `length`); the episode waits for the program's return within multi_turn.step_timeout_s."""

    def __init__(self, agent: CustomReward, eos_token: str | None):
        self.agent, self.eos = agent, eos_token or ""
        self.events: queue.Queue = queue.Queue()  # ("request", messages) | ("done", reward) | ("error", exc)
        self.replies: queue.Queue = queue.Queue()  # the policy's reply to the request that waits
        self.history: list[dict] = []
        self.last_turn_done = False

    def reset(self, row: dict, seed: int) -> list[dict]:
        hub = agent_hub()
        self.id = uuid.uuid4().hex
        hub.episodes[self.id] = self
        play = self.agent.function()  # imported in this process on the first episode
        args = (hub.base_url(self.id), dict(row), seed)
        threading.Thread(target=self._run, args=(play, *args), name=f"agent {self.id}", daemon=True).start()
        kind, value = self.events.get()
        if kind != "request":
            self._close()
            raise value if kind == "error" else RewardError("the agent returned without asking the policy")
        self.history = value
        return value

    def _run(self, play, base_url: str, row: dict, seed: int) -> None:
        try:
            self.events.put(("done", play(base_url, row, seed)))
        except BaseException as exc:  # noqa: BLE001 - the rollout names the agent and the episode
            self.events.put(("error", exc))

    def ask(self, body: dict) -> dict:
        """A request of the program (in the endpoint's thread): the policy's reply once the rollout has it."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: a non-empty list of {role, content} is required")
        if self.last_turn_done:  # the episode has had its multi_turn.max_turns replies
            return completion("", False, body, 0, 0)
        self.events.put(("request", messages))
        text, ended = self.replies.get()
        return completion(text, ended, body, 0, 0)

    def step(self, text: str, last_turn: bool) -> Step:
        ended = bool(self.eos) and text.endswith(self.eos)
        reply = text.removesuffix(self.eos) if ended else text
        self.history = [*self.history, {"role": "assistant", "content": reply}]
        self.last_turn_done = last_turn
        self.replies.put((reply, ended))
        # after the last reply, ask() answers further requests itself: only the program's return comes here
        kind, value = self.events.get()
        if kind == "request":
            try:
                observation = new_messages(self.history, value)
            except ValueError as exc:
                self._close()
                raise RewardError(f"the agent's request: {exc}") from None
            self.history = value
            return Step(observation=observation, role="user")
        self._close()
        if kind == "error":
            raise value
        return Step(reward=value, done=True)

    def close(self) -> None:
        """The rollout ended the episode early (its context is full): the request that waits gets an empty
        reply, any later one too, and the program's return is not waited for."""
        self.last_turn_done = True
        self.replies.put(("", False))
        self._close()

    def _close(self) -> None:
        agent_hub().episodes.pop(getattr(self, "id", ""), None)


@register("agent")
def agent_env(settings, tools: dict):
    """A new episode of the agent program of multi_turn.agent per sample."""
    agent = load_agent(settings.agent)
    return lambda: AgentEpisode(agent, settings.eos_token)
