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
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from components.data import templates
from components.errors import RewardError
from components.rollout.multi_turn import turns_after_reply
from components.seeding import derive_seed
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
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802  (http.server's name)
                parts = self.path.strip("/").split("/")
                if len(parts) != 5 or parts[0] != "episodes" or parts[2:] != ["v1", "chat", "completions"]:
                    return self._answer(404, {"error": {"message": f"no such endpoint {self.path}"}})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    return self._answer(200, server.complete(parts[1], body))
                except (ValueError, KeyError, TypeError) as exc:
                    return self._answer(
                        400, {"error": {"message": str(exc), "type": "invalid_request_error"}}
                    )

            def _answer(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # one line per request on stderr is noise in a rollout
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
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
        finish = "stop" if ep.ended_with_eos else "length"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "policy"),
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            ],
            "usage": {
                "prompt_tokens": len(context),
                "completion_tokens": len(new),
                "total_tokens": len(context) + len(new),
            },
        }

    def _context(self, ep: Episode, messages: list[dict]) -> list[int]:
        """The ids the next reply continues: the first request rendered whole; a later one's new messages only,
        after the ids the episode holds (ValueError when it does not repeat the conversation so far)."""
        if ep.calls == 0:
            text = templates.render(self.tokenizer, messages, add_generation_prompt=True)
            ep.prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return list(ep.prompt)
        held = len(ep.messages)
        if messages[:held] != ep.messages:
            raise ValueError(
                "messages must repeat the conversation so far, each reply as it was returned (token in, token "
                "out: the episode's tokens are never tokenized again)"
            )
        text = turns_after_reply(self.tokenizer, messages[held:], ep.ended_with_eos)
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
