"""A model directory's chat template is data: it renders with bounds on its time, its output and the values it
builds, and a template that fails is one line naming the directory.

transformers renders chat templates in Jinja's ImmutableSandboxedEnvironment, which stops attribute escapes
and caps `range()` at 100,000 items, but bounds neither time (nested loops run for hours) nor size (`'x' * 10**9`,
a filter's width, a loop printing a large string). `install()` tightens that environment class for this process:

- the `*`, `**` and `%` operators are checked before they build anything too large (Jinja compiles intercepted
  operators into a call of the environment's `call_binop`), as is every integer argument of a call or filter
  (`center(10**9)`); constants are not folded at compile time, so all of this runs while rendering;
- the joined output (the environment's `concat`, which every render and block goes through) stops at
  MAX_CHARS;
- `render()` runs the template's own code (compiled Python named `<template>`) under a line tracer that stops it
  after MAX_SECONDS, in loops that print nothing as well.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Iterable

from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from components.bounds import weight
from components.errors import ConfigError

MAX_SECONDS = 2.0  # one render (a prompt, or a multi-turn episode's turns)
MAX_CHARS = 1 << 20  # its output, and any one value it builds
MAX_BITS = 1 << 14  # an integer it computes
_WIDE_FORMAT = re.compile(
    r"%[-+ #0]*(\d{7,}|\*)|%[-+ #0]*\d*\.(\d{7,}|\*)"
)  # a width or precision of millions


class TemplateLimit(SecurityError):
    """A template went past a bound (MAX_SECONDS, MAX_CHARS, MAX_BITS)."""


def _check_binop(operator: str, left, right) -> None:
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
    if operator == "*":
        if ints and left.bit_length() + right.bit_length() > MAX_BITS:
            raise TemplateLimit("built an integer too large")
        for seq, times in ((left, right), (right, left)):
            repeated = isinstance(seq, (str, list, tuple)) and isinstance(times, int)
            if repeated and weight(seq) * max(times, 0) > MAX_CHARS:
                raise TemplateLimit(f"built a value of more than {MAX_CHARS} characters")
    elif operator == "**" and ints and right > 0 and abs(left) > 1:
        if left.bit_length() * right > MAX_BITS:
            raise TemplateLimit("built an integer too large")
    elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
        raise TemplateLimit("formats with a width or precision of millions")


def _check_args(values: Iterable, formats: bool = False) -> None:
    """TemplateLimit for an integer argument past MAX_CHARS (a width, a count), and with `formats` for a format
    string with a width or precision of millions."""
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_CHARS:
            raise TemplateLimit(f"passed {v} to a call or filter (a width or count of more than {MAX_CHARS})")
        if formats and isinstance(v, str) and _WIDE_FORMAT.search(v):
            raise TemplateLimit("formats with a width or precision of millions")


def _checked_filter(name: str, f):
    """A filter whose arguments are checked first. Compiled templates call filters directly (not through the
    environment's `call`), and the compiler would fold a filter of constants at compile time."""

    @functools.wraps(f)  # keeps Jinja's pass_context / pass_eval_context marks
    def checked(*args, **kwargs):
        _check_args((*args, *kwargs.values()), formats=name == "format")
        return f(*args, **kwargs)

    return checked


def bounded_concat(chunks: Iterable[str]) -> str:
    """The output joined, stopping at MAX_CHARS."""
    parts, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_CHARS:
            raise TemplateLimit(f"rendered more than {MAX_CHARS} characters")
        parts.append(chunk)
    return "".join(parts)


def install() -> None:
    """Bound every ImmutableSandboxedEnvironment of this process (transformers' chat templates); idempotent.
    Takes effect for templates compiled from now on: call it before any chat template renders."""
    cls = ImmutableSandboxedEnvironment
    if getattr(cls, "_reinforge_bounded", False):
        return
    init, call_binop, call = cls.__init__, cls.call_binop, cls.call

    def bounded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.filters = {name: _checked_filter(name, f) for name, f in self.filters.items()}

    def checked_binop(self, context, operator, left, right):
        _check_binop(operator, left, right)
        return call_binop(self, context, operator, left, right)

    def checked_call(__self, __context, __obj, *args, **kwargs):
        _check_args((*args, *kwargs.values()))
        return call(__self, __context, __obj, *args, **kwargs)

    cls.__init__ = bounded_init
    cls.optimized = False  # no constant folding: nothing of a template runs while it compiles, untimed
    cls.intercepted_binops = frozenset({"*", "**", "%"})
    cls.call_binop = checked_binop
    cls.call = checked_call
    cls.concat = staticmethod(bounded_concat)
    cls._reinforge_bounded = True


def _timed(deadline: float):
    """A trace function that stops a template's own code (and only it) after `deadline`."""

    def line(frame, event, arg):
        if event == "line" and time.monotonic() > deadline:
            raise TemplateLimit(f"ran for more than {MAX_SECONDS:g} s")
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename == "<template>" else None

    return call


def render(tokenizer, conversation, **kwargs) -> str:
    """tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs), bounded; ConfigError in one line
    naming the model directory when its template goes past a bound or fails."""
    install()
    previous = sys.gettrace()
    sys.settrace(_timed(time.monotonic() + MAX_SECONDS))
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the template raises is the template's
        what = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        verb = "" if isinstance(exc, TemplateLimit) else f"failed ({type(exc).__name__}: "
        raise ConfigError(
            f"the chat template of {getattr(tokenizer, 'name_or_path', 'the model directory')} "
            f"{verb}{what}{')' if verb else ''}; render a model's template only when you trust it: fix or remove "
            "its chat_template, or give the prompts as plain strings with data.apply_chat_template=false."
        ) from None
    finally:
        sys.settrace(previous)
