"""Load a YAML config, apply `key=value` overrides, validate, and explain what is wrong."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from components.config.schema import Config
from components.errors import ConfigError


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Turn ["algorithm.beta=0.1", ...] into a nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override `{item}` is not key=value (e.g. algorithm.beta=0.1)")
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override `{item}`: `{part}` is both a value and a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return tree


# Other frameworks' names for our keys: (section, alias) -> key. Renamed in the file and in the overrides
# before they are merged, so a later `algorithm.beta=` override still wins over the file's kl_loss_coef.
ALIASES = {("algorithm", "beta"): "kl_loss_coef"}


def _rename_aliases(tree: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for (section, alias), key in ALIASES.items():
        node = out.get(section)
        if isinstance(node, dict) and alias in node:
            node[key] = node.pop(alias)
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
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass --config configs/arith_grpo.yaml or a file "
                              "of your own")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(raw).__name__}")
    raw = _merge(_rename_aliases(raw), _rename_aliases(parse_overrides(overrides)))
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        for e in exc.errors():  # a cross-field check raised its own ConfigError: pass it on as it is
            if isinstance((e.get("ctx") or {}).get("error"), ConfigError):
                raise e["ctx"]["error"] from None
        lines = [_explain(e) for e in exc.errors()]
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid config{where}:\n  - " + "\n  - ".join(lines)) from None


# Keys that do not change what an iteration computes: a checkpoint made under other values still resumes.
RESUME_NEUTRAL = ("trainer.iterations", "trainer.resume_mode", "trainer.progress", "trainer.save_interval",
                  "trainer.test_interval", "trainer.eval_k", "trainer.eval_size", "trainer.experiment_name",
                  "trainer.max_checkpoints_to_keep", "trainer.num_threads", "trainer.save_optimizer",
                  # how the update is spread over workers: the same step (within rounding) and a checkpoint
                  # format that does not depend on it, so a group rebuilt smaller resumes the run
                  "trainer.num_workers", "trainer.strategy", "trainer.data_parallel_size", "trainer.zero_stage",
                  "trainer.worker_resources", "trainer.min_workers", "trainer.grad_compression",
                  "trainer.compression_fp16_below_gbps", "trainer.compression_powersgd_below_gbps",
                  "trainer.simulated_bandwidth_gbps", "trainer.stage_timeout_s", "trainer.max_worker_rebuilds")


def fingerprint(cfg: Config, **inputs: str) -> str:
    """sha256 of every key that shapes training and of `inputs` (e.g. the training data's md5): auto-resume
    only continues a checkpoint made with the same one, so new data or a changed key trains afresh."""
    import hashlib
    import json

    flat = {k: v for k, v in flatten(cfg).items() if not any(k == n or k.startswith(n + ".") for n in RESUME_NEUTRAL)}
    return hashlib.sha256(json.dumps([flat, inputs], sort_keys=True, default=str).encode()).hexdigest()


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
