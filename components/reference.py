"""The full reference config, generated from the typed config models: every key at its default with its
one-line help as a comment (`reinforge config generate`; configs/reference.yaml is that file, checked by a
test), and a config as it resolves, each value with where it came from (`reinforge config show`).
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from components.config.loader import flatten, parse_overrides, read_yaml
from components.config.schema import Config

HEADER = (
    "# The full reinforge config: every key at its default, with its help. Generated from the typed config\n"
    "# models (components/config/schema.py) by `reinforge config generate`; do not edit by hand: a test fails\n"
    "# when this file is out of date. A run's config sets only what differs (configs/arith_grpo.yaml).\n"
)


def _scalar(value: Any) -> str:
    """One YAML value on one line, as yaml.safe_dump writes it."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def _lines(model: type[BaseModel], instance: BaseModel, indent: int) -> list[str]:
    out, pad = [], "  " * indent
    for name, field in model.model_fields.items():
        value = getattr(instance, name)
        help_ = (field.description or "").replace("\n", " ")
        comment = f"  # {help_}" if help_ else ""
        if isinstance(value, BaseModel):
            out.append(f"{pad}{name}:{comment}")
            out += _lines(type(value), value, indent + 1)
        else:
            plain = value.model_dump() if isinstance(value, BaseModel) else value
            out.append(f"{pad}{name}: {_scalar(plain)}{comment}")
    return out


def reference_config() -> str:
    """The reference YAML: every section and key of Config at its default, with its description."""
    return HEADER + "\n".join(_lines(Config, Config(), 0)) + "\n"


def _preset_values(cfg: Config) -> dict[str, Any]:
    """The algorithm keys the preset fills in (unset in the config), at the values the run uses."""
    from dataclasses import asdict

    from components.algorithms.presets import resolve

    flat = flatten(cfg)
    return {
        f"algorithm.{k}": v
        for k, v in asdict(resolve(cfg.algorithm)).items()
        if f"algorithm.{k}" in flat and flat[f"algorithm.{k}"] is None
    }


def _keys_of(raw: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in raw.items():
        dotted = f"{prefix}.{k}" if prefix else str(k)
        keys |= _keys_of(v, dotted) if isinstance(v, dict) else {dotted}
    return keys


def resolved_config(path: str | None, overrides: list[str]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, source) of every key of the config `path` with `overrides`, the preset's values
    filled in; source is default, preset, file or override (the last that set it)."""
    from components.validate import load_checked

    cfg = load_checked(path, overrides)  # a bad preset or knob name is a one-line error here too
    from_file = _keys_of(read_yaml(path)) if path else set()
    from_overrides = _keys_of(parse_overrides(overrides))
    preset = _preset_values(cfg)
    rows = []
    for key, value in flatten(cfg).items():
        source = "default"
        if key in preset:
            value, source = preset[key], "preset"
        if any(key == k or key.startswith(k + ".") for k in from_file):
            source = "file"
        if any(key == k or key.startswith(k + ".") for k in from_overrides):
            source = "override"
        rows.append((key, value, source))
    return rows
