"""A model directory's chat template renders with bounds on its time, output and values; one that goes past them
or fails is one line naming the directory."""

from __future__ import annotations

import shutil
import time
import tracemalloc

import pytest

from components.data import templates
from components.data.prompts import render_prompt
from components.errors import ConfigError
from components.models.loading import load_tokenizer
from components.settings import PromptSettings
from tests.conftest import refused_in_one_line

HOSTILE = {
    "nested loops printing nothing": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "nested loops printing": "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
    "a string repeated": "{{ 'x' * 1000000000 }}",
    "a list repeated": "{{ ([ 'y' * 1000 ] * 2000000)|join }}",
    "a filter's width": "{{ 'x'|center(1000000000) }}",
    "a method's width": "{{ 'x'.ljust(1000000000) }}",
    "a format width": "{{ '%01000000000d' % 1 }}",
    "a format filter": "{{ '%.999999999f'|format(1.0) }}",
    "a power": "{{ 7 ** 100000000 }}",
    "a big string printed often": "{% set s = 'z' * 100000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
}


@pytest.fixture()
def tokenizer_with(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)

    def with_template(template: str):
        tok.chat_template = template
        return tok

    return with_template


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_template_that_runs_long_or_builds_large_is_stopped_in_one_line(tokenizer_with, name):
    tok = tokenizer_with(HOSTILE[name])
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(ConfigError) as err:
            render_prompt(
                tok, [{"role": "user", "content": "1+1="}], PromptSettings(apply_chat_template=True)
            )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert message.startswith(f"the chat template of {tok.name_or_path} ") and "\n" not in message
    assert time.monotonic() - start < templates.MAX_SECONDS + 3 and peak < 64 << 20, peak >> 20


def test_a_template_that_raises_is_one_line_naming_the_directory(tokenizer_with):
    tok = tokenizer_with("{{ raise_exception('this model takes no user turns') }}")
    with pytest.raises(ConfigError, match=r"failed \(TemplateError: this model takes no user turns\)"):
        render_prompt(tok, "1+1=", PromptSettings(apply_chat_template=True))


def test_an_ordinary_template_renders_as_before(tokenizer_with, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=False
    )
    assert render_prompt(tok, "1+1=", PromptSettings(apply_chat_template=True)) == plain


def test_the_command_names_a_model_directorys_hostile_template_in_one_line(tiny_model_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    (d / "chat_template.jinja").write_text(HOSTILE["nested loops printing nothing"])
    err = refused_in_one_line(["generate", "--model_path", str(d), "--apply-chat-template", "true", "1+1="])
    assert f"error: the chat template of {d} ran for more than" in err
