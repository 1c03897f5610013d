"""Sample completions from a model for prompts given on the command line (no Ray, no tracking)."""

from __future__ import annotations

import argparse
import json
import sys

from components.data.prompts import MESSAGES, PromptSettings, check_fits, prompt_form
from components.errors import ConfigError, ReinforgeError
from components.rollout.base import SamplingParams
from components.rollout.worker import RolloutWorker
from components.tracking import runs


def generate(
    model_path: str,
    prompts: list,
    n: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    settings: PromptSettings = PromptSettings(),
) -> list[dict]:
    """params.n completions of each prompt (a plain string, or a list of chat messages)."""
    worker = RolloutWorker(str(runs.model_dir(model_path)), key="--model_path", prompts=settings)
    for prompt in prompts:
        check_fits(worker.tokenizer, prompt_form(prompt), settings, "the command line")
    rows = [
        {"prompt": p, "reward_model": {"ground_truth": ""}, "data_source": "cli", "extra_info": {}}
        for p in prompts
    ]
    batch = worker.generate(
        rows, SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens), seed, iteration=0
    )
    texts = worker.decode(batch)
    return [{"prompt": prompts[i // n], "completion": texts[i]} for i in range(len(texts))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="reinforge generate", description="Sample completions from a local model."
    )
    p.add_argument(
        "prompts",
        nargs="+",
        help="prompt texts, e.g. '12+34=' (with --messages: JSON lists of chat messages)",
    )
    p.add_argument(
        "--messages", action="store_true", help="each prompt is a JSON list of {role, content} messages"
    )
    p.add_argument(
        "--apply-chat-template",
        choices=["true", "false"],
        default=None,
        help="render prompts through the chat template (default: messages yes, plain strings no, as "
        "data.apply_chat_template)",
    )
    p.add_argument(
        "--model_path",
        default="checkpoints/grpo",
        help="HF model directory, or a training output directory (its last finished run's final model)",
    )
    p.add_argument("-n", type=int, default=1, help="completions per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    settings = PromptSettings(None if a.apply_chat_template is None else a.apply_chat_template == "true")
    try:
        prompts = [_messages(p) for p in a.prompts] if a.messages else a.prompts
        out = generate(a.model_path, prompts, a.n, a.temperature, a.max_new_tokens, a.seed, settings)
    except ReinforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
