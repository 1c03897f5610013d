"""An agent program for multi_turn.env=agent (docs/environments.md): it plays guess-the-number against the
policy through the `openai` client, as any agent behind an OpenAI-compatible base_url would, and returns
its reward. `multi_turn.agent=agents/guess_number.py:play`."""

from __future__ import annotations

import random

from openai import OpenAI


def play(base_url: str, row: dict, seed: int) -> float:
    """A number 0-9 drawn from the episode's seed; up to three guesses, each answered higher or lower.
    Reward 1 for a right guess, else 0."""
    target = random.Random(seed).randint(0, 9)
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Guess my number, 0 to 9. Answer with one digit."}]
    for _ in range(3):
        answer = client.chat.completions.create(model="policy", messages=messages)
        reply = answer.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        guess = reply.strip()[:1]
        if guess == str(target):
            return 1.0
        higher = guess.isdigit() and int(guess) < target
        messages.append({"role": "user", "content": "higher" if higher else "lower"})
    return 0.0
