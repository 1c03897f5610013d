"""Sample completions from a model for prompts given on the command line (no Ray, no tracking)."""

from __future__ import annotations

import json
import sys

from components.data.prompts import MESSAGES, prompt_form
from components.errors import ConfigError, ReinforgeError
from components.generation import Completer
from components.settings import PromptSettings
from flows import parsers
from flows._args import report


def generate(
    model_path: str,
    prompts: list,
    n: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    settings: PromptSettings = PromptSettings(),
    trust_remote_code: bool = False,
) -> list[dict]:
    """n completions of each prompt (a plain string, or a list of chat messages)."""
    complete = Completer(model_path, settings, trust_remote_code=trust_remote_code)
    return complete(prompts, n, temperature, max_new_tokens, seed)


def main(argv: list[str] | None = None) -> int:
    a = parsers.generate().parse_args(argv)
    settings = PromptSettings(None if a.apply_chat_template is None else a.apply_chat_template == "true")
    try:
        prompts = [_messages(p) for p in a.prompts] if a.messages else a.prompts
        out = generate(
            a.model_path, prompts, a.n, a.temperature, a.max_new_tokens, a.seed, settings, a.trust_remote_code
        )
    except ReinforgeError as exc:
        return report(exc, a.debug)
    print(json.dumps(out, indent=2))
    return 0


def _messages(text: str) -> list[dict]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(
            f"--messages: {text[:60]!r} is not JSON ({exc}); give a list such as "
            '\'[{"role": "user", "content": "12+34="}]\''
        ) from None
    if prompt_form(value) != MESSAGES:
        raise ConfigError(f"--messages: {text[:60]!r} is not a list of {{role, content}} messages")
    return value


if __name__ == "__main__":
    sys.exit(main())
