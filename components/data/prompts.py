"""Prompts in the two forms users bring, turned into token ids one way for every stage.

A prompt is either a list of chat messages (`[{"role": "user", "content": ...}]`, verl's format) or a plain
string (TRL's "standard" format). `data.apply_chat_template` decides whether it goes through the tokenizer's
chat template: None (the default) means yes for messages and no for strings. Without the template a string is
tokenized as it is, with the special tokens the tokenizer adds by itself (a BOS for Llama), as TRL does.
Messages need a template: a tokenizer without one is a config error naming `data.apply_chat_template`.

SFT, cleaning, rollout, evaluation and the reward model all call `encode_prompt`, so the ids a row is trained
on in SFT are the ids the rollout engine samples from.
"""

from __future__ import annotations

from typing import Any

from components.data import templates
from components.errors import ConfigError
from components.settings import MESSAGES, PromptSettings

TEXT = "text"  # a prompt given as a plain string (MESSAGES: chat messages)


def prompt_form(prompt: Any) -> str | None:
    """MESSAGES, TEXT, or None when the value is neither (a number, a list of something else, a message
    without string role and content).

    >>> prompt_form("1+2="), prompt_form([{"role": "user", "content": "1+2="}]), prompt_form([{"content": 3}])
    ('text', 'messages', None)
    """
    if isinstance(prompt, str):
        return TEXT
    if (
        isinstance(prompt, (list, tuple))
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
    ):
        return MESSAGES
    return None


def prompt_text(prompt: Any) -> str:
    """The text a person wrote: the string, or the messages' contents joined (for empty checks and dedup)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in prompt)


def check_fits(tokenizer, form: str, settings: PromptSettings, where: str) -> None:
    """ConfigError naming data.apply_chat_template when prompts of `form` (those of the data file `where`)
    cannot be rendered as configured with this tokenizer."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    model = getattr(tokenizer, "name_or_path", "") or "the tiny model"
    if form == MESSAGES and settings.apply_chat_template is False:
        raise ConfigError(
            f"data.apply_chat_template=false, but the prompts in {where} are chat messages, which "
            "only a chat template turns into text. Set data.apply_chat_template=true (or leave it "
            "unset), or give the prompts as plain strings."
        )
    if settings.templated(form) and not has_template:
        what = "are chat messages" if form == MESSAGES else "go through it (data.apply_chat_template=true)"
        raise ConfigError(
            f"data.apply_chat_template: the tokenizer of {model} has no chat template, but the "
            f"prompts of {where} {what}. Give the prompts as plain strings with data.apply_chat_template="
            "false (or unset), or use a model whose tokenizer has a chat template."
        )


def render_prompt(tokenizer, prompt: Any, settings: PromptSettings, tools: list[dict] | None = None) -> str:
    """The text the model sees before its answer: the chat template with the generation prompt (and `tools`'
    schemas, for templates that show them), or the plain string."""
    form = prompt_form(prompt)
    if not settings.templated(form):
        return prompt
    messages = [{"role": "user", "content": prompt}] if form == TEXT else [dict(m) for m in prompt]
    extra = {"tools": tools} if tools else {}
    return templates.render(tokenizer, messages, add_generation_prompt=True, **extra)


def encode_prompt(
    tokenizer, prompt: Any, settings: PromptSettings, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of one prompt. A templated prompt's special tokens come from the template; a plain string gets
    the ones the tokenizer adds itself."""
    text = render_prompt(tokenizer, prompt, settings, tools)
    templated = settings.templated(prompt_form(prompt))
    return tokenizer(text, add_special_tokens=not templated)["input_ids"]


def encode_prompts(
    tokenizer, prompts: list, settings: PromptSettings, tools: list[dict] | None = None
) -> list[list[int]]:
    return [encode_prompt(tokenizer, p, settings, tools) for p in prompts]
