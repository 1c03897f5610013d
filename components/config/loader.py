"""Load a YAML config, apply `key=value` overrides, validate, and explain what is wrong."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from components.config.schema import Config
from components.errors import ConfigError


def line_break(key: str) -> ConfigError:
    """An override whose value holds a line break: YAML would fold it into a space, silently."""
    return ConfigError(
        f"override `{key.strip()}`: its value holds a line break, which YAML would turn into a space; "
        'give it on one line (write a line break as \\n inside double quotes: key="a\\nb")'
    )


def check_given(items: Iterable[str], where: str = "on the command line") -> list[str]:
    """Overrides as a user gave them (`where`): a list of key=value strings, each key once (a config file
    refuses a repeated key too: which one was meant?). Returns them. The flows layer their own defaults in
    front of these, where a later key wins (parse_overrides)."""
    if isinstance(items, str) or not all(isinstance(i, str) for i in items):
        raise ConfigError(
            f"overrides {where}: {items!r} is not a list of key=value strings; write it as a list, "
            '["algorithm.beta=0.04"], not a string (it would be read one character at a time)'
        )
    given: dict[str, str] = {}
    for item in items:
        key, _, raw = item.partition("=")
        key = key.strip()
        if "\n" in raw or "\r" in raw:
            raise line_break(key)
        if key in given:
            raise ConfigError(
                f"override `{key}` is given twice {where} (`{given[key]}` and `{item}`); give it once"
            )
        given[key] = item
    return list(items)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Turn ["algorithm.beta=0.1", ...] into a nested dict; values are parsed as YAML scalars. A key given
    again replaces the earlier value (a flow's defaults, then the user's overrides: check_given)."""
    tree: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override `{item}` is not key=value (e.g. algorithm.beta=0.1)")
        if "\n" in raw or "\r" in raw:
            raise line_break(key)
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override `{item}`: `{part}` is both a value and a section")
        try:
            node[parts[-1]] = load_yaml_text(raw, f"override `{key}`") if raw.strip() else None
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(
                f"override `{item}`: the value is not valid YAML ({problem}); quote it, or write a "
                "list as [a, b] and a mapping as {k: v}"
            ) from None
    return tree


def _mark(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


# how many values a YAML document may stand for once its aliases are expanded: a config has a few hundred; nested
# aliases ("billion laughs") can make a few hundred bytes stand for billions, which every later step would walk
MAX_EXPANDED_NODES = 100_000


def _check_nodes(root, where: str) -> None:
    """One walk over the composed YAML, each node once however many aliases point at it (linear in the file):
    ConfigError naming the first key a mapping holds twice, with both lines (YAML itself keeps the last value
    silently, and a repeated section would replace the earlier one whole), and when the document expands past
    MAX_EXPANDED_NODES values through its aliases."""
    expanded: dict[int, int] = {}  # id(node) -> the values it stands for, aliases expanded

    def walk(node, prefix: str) -> int:
        if id(node) in expanded:  # an alias to a node already walked: its size is known
            return expanded[id(node)]
        expanded[id(node)] = 1  # a cycle (a recursive alias) counts once
        size = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = key_node.value
                dotted = f"{prefix}.{key}" if prefix else str(key)
                if isinstance(key, str) and key in seen:
                    raise ConfigError(
                        f"{where}: key `{dotted}` is set twice (line {seen[key].line + 1} and line "
                        f"{key_node.start_mark.line + 1}); keep one of them."
                    )
                if isinstance(key, str):
                    seen[key] = key_node.start_mark
                size += 1 + walk(value_node, dotted)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                size += walk(item, prefix)
        if size > MAX_EXPANDED_NODES:
            raise ConfigError(
                f"{where}: {_mark(node.start_mark)}: this value expands to more than {MAX_EXPANDED_NODES:,} "
                "values through YAML aliases (&anchor / *alias); write the values out, or alias less."
            )
        expanded[id(node)] = size
        return size

    walk(root, "")


def load_yaml_text(text: str, where: str):
    """YAML text parsed safely and in time linear in its length: composed, checked (_check_nodes), then
    constructed; None for an empty document."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is None:
        return None
    _check_nodes(node, where)
    return yaml.SafeLoader(text).construct_document(node)


def read_yaml(path: str | Path, what: str = "config file") -> Any:
    """A YAML file parsed strictly: UTF-8 only, no key twice in one mapping, not empty. Every problem is one
    ConfigError naming the file, line and column."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"{what} {p} does not exist; pass --config configs/arith_grpo.yaml or a file of your own"
        )
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(
            f"{p}: line {line}, column {column}: byte {data[exc.start]:#04x} is not UTF-8; save "
            "the file as UTF-8."
        ) from None
    try:
        value = load_yaml_text(text, str(p))
        if value is None:
            raise ConfigError(
                f"{what} {p} is empty; give at least one section (e.g. `trainer:`), or leave "
                "--config out to use configs/arith_grpo.yaml."
            )
        return value
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{_mark(mark)}: " if mark is not None else ""
        raise ConfigError(f"{p}: {where}not valid YAML: {exc.problem or exc.context}.") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {str(exc).splitlines()[0]}.") from None


# Other frameworks' names for our keys: (section, alias) -> key. Renamed in the file and in the overrides
# before they are merged, so a later `algorithm.beta=` override still wins over the file's kl_loss_coef.
ALIASES = {("algorithm", "beta"): "kl_loss_coef"}


def _rename_aliases(tree: dict[str, Any], where: str) -> dict[str, Any]:
    """Aliases renamed to their keys; an alias and its key both set to different values in one source (`where`:
    the file, or the overrides) is an error, since one would silently win."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for (section, alias), key in ALIASES.items():
        node = out.get(section)
        if not (isinstance(node, dict) and alias in node):
            continue
        value = node.pop(alias)
        if key in node and node[key] != value:
            raise ConfigError(
                f"{where}: {section}.{alias}={value!r} and {section}.{key}={node[key]!r} are one key "
                f"under two names; set only {section}.{key}."
            )
        node[key] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _section_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that holds the field at `loc` (for listing valid keys)."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _explain(err: dict) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc)
    if err["type"] == "extra_forbidden":
        section = _section_at(loc)
        valid = sorted(section.model_fields) if section else []
        aliases = [alias for (sec, alias) in ALIASES if len(loc) == 2 and sec == loc[0]]
        close = difflib.get_close_matches(str(loc[-1]), valid + aliases, n=1)
        hint = f" Did you mean `{'.'.join([*map(str, loc[:-1]), close[0]])}`?" if close else ""
        return f"{key}: unknown key.{hint} Valid keys here: {', '.join(valid)}."
    section = _section_at(loc)
    field = section.model_fields.get(str(loc[-1])) if section else None
    help_ = f" ({field.description})" if field is not None and field.description else ""
    return f"{key}: {err['msg']}; got {err.get('input')!r}{help_}."


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Read `path` (YAML), apply overrides, and return a validated Config or raise ConfigError."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    raw = _merge(
        _rename_aliases(raw, str(path)), _rename_aliases(parse_overrides(overrides), "the overrides")
    )
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        for e in exc.errors():  # a cross-field check raised its own ConfigError: pass it on as it is
            if isinstance((e.get("ctx") or {}).get("error"), ConfigError):
                raise e["ctx"]["error"] from None
        lines = [_explain(e) for e in exc.errors()]
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid config{where}:\n  - " + "\n  - ".join(lines)) from None


def training_keys(cfg: Config) -> dict[str, Any]:
    """Every flattened key that shapes what training computes: the train stage's keys but its neutral ones
    (components/config/stages.py)."""
    from components.config.stages import STAGES

    return {k: v for k, v in flatten(cfg).items() if STAGES["train"].shapes(k)}


def fingerprint(cfg: Config, **inputs: str) -> str:
    """sha256 of every key that shapes training and of `inputs` (e.g. the training data's md5): auto-resume
    only continues a checkpoint made with the same one, so new data or a changed key trains afresh."""
    import hashlib
    import json

    return hashlib.sha256(
        json.dumps([training_keys(cfg), inputs], sort_keys=True, default=str).encode()
    ).hexdigest()


def flatten(cfg: Config) -> dict[str, Any]:
    """Dotted key -> scalar value, for MLflow params."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = node

    walk("", cfg.model_dump())
    return out
