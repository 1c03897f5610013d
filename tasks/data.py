"""Data tasks: generate or import raw rows, clean them into the train/eval files, and load them for a flow."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from prefect import task

from components.config import Config
from components.data.clean import RowRules, clean_file, dedup_key, validate_file
from components.data.formats import ROW_SCHEMA, arithmetic_rows, gsm8k_splits
from components.data.io import read_rows, to_plain, write_parquet
from components.lineage import verify_tracked
from components.models.loading import load_tokenizer
from components.models.tiny import build_char_tokenizer
from components.stages import STAGES
from tasks.caching import StageCache, cached_stage
from tasks.common import logger, stage


def _raw_files(inputs: dict) -> list[str]:
    raw = Path(inputs["cfg"].data.raw_dir)
    return [str(raw / "train.parquet"), str(raw / "test.parquet")]


def _clean_outputs(inputs: dict) -> list[str]:
    d = inputs["cfg"].data
    return [d.train_path, d.eval_path]


def _gsm8k_files(inputs: dict) -> list[str]:
    d = inputs["cfg"].data
    return [p for p in (d.gsm8k_path, d.gsm8k_test_path) if p]


def tokenizer_source(cfg: Config) -> tuple[str, str] | None:
    """(config key, directory) of the tokenizer prompts will be encoded with: the model SFT starts from
    (sft.base_model), or the policy when it does not come out of this project's SFT; None = the tiny model's
    character tokenizer, which SFT builds."""
    if cfg.sft.base_model:
        return "sft.base_model", cfg.sft.base_model
    if Path(cfg.actor.model.path).resolve() != Path(cfg.sft.output_dir).resolve():
        return "actor.model.path", cfg.actor.model.path
    return None


def _tokenizer_of(source: tuple[str, str] | None, cfg: Config):
    if source is None:  # the tiny model's, with the tool-call tokens for multi-turn runs
        return build_char_tokenizer(tool_tokens=cfg.multi_turn.enable or cfg.data.task == "arith_tool")
    key, path = source
    return load_tokenizer(path, key)


def data_tokenizer(cfg: Config):
    """The tokenizer of tokenizer_source: what the clean stage checks prompts with."""
    return _tokenizer_of(tokenizer_source(cfg), cfg)


def sft_tokenizer(cfg: Config):
    """The tokenizer SFT trains with: sft.base_model's, or the tiny model's it builds."""
    return _tokenizer_of(("sft.base_model", cfg.sft.base_model) if cfg.sft.base_model else None, cfg)


def _tokenizer_files(inputs: dict) -> list[str]:
    source = tokenizer_source(inputs["cfg"])
    if source is None:
        return []
    return [
        str(Path(source[1]) / name)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    ]


PREPARE_CACHE = StageCache(config_keys=STAGES["prepare"].reads, reads=_gsm8k_files, writes=_raw_files)
CLEAN_CACHE = StageCache(
    config_keys=STAGES["clean"].reads,
    reads=lambda i: _raw_files(i) + _tokenizer_files(i),
    writes=_clean_outputs,
)


@task(name="prepare-data", timeout_seconds=600, **cached_stage(PREPARE_CACHE))
def prepare_data(cfg: Config) -> list[str]:
    """Write data.raw_dir/{train,test}.parquet: the arithmetic task, or an import of data.gsm8k_path (with
    data.gsm8k_test_path, or a seeded held-out split of it)."""
    d = cfg.data
    raw = Path(d.raw_dir)
    if d.gsm8k_path:
        train, test = gsm8k_splits(d.gsm8k_path, d.gsm8k_test_path, d.num_eval, cfg.trainer.seed)
    else:
        train, test = arithmetic_rows(
            d.num_train,
            d.num_eval,
            d.max_operand,
            d.operations,
            cfg.trainer.seed,
            d.tool_sft_fraction if d.task == "arith_tool" else None,
        )
    paths = [
        write_parquet(rows, raw / name, ROW_SCHEMA)
        for rows, name in ((train, "train.parquet"), (test, "test.parquet"))
    ]
    logger().info("prepared %d train and %d test rows in %s", len(train), len(test), raw)
    return [str(p) for p in paths]


@task(name="clean-data", timeout_seconds=600, **cached_stage(CLEAN_CACHE))
def clean_data(cfg: Config) -> list[dict]:
    """Validate raw rows; write clean files and quarantine files (with reasons); log the counts. Held-out
    rows whose prompt is a training prompt are quarantined (`in_train`)."""
    d = cfg.data
    tokenizer, rules = data_tokenizer(cfg), RowRules.from_config(cfg)
    raw = Path(d.raw_dir)
    reports, train_keys = [], None
    for src, dst in ((raw / "train.parquet", d.train_path), (raw / "test.parquet", d.eval_path)):
        r = clean_file(src, dst, d.quarantine_dir, tokenizer, rules, train_keys)
        logger().info(
            "%s: %d rows in, %d kept, %d quarantined %s -> %s",
            src,
            r.input_rows,
            r.kept,
            r.quarantined,
            r.reasons or "",
            r.quarantine_path,
        )
        reports.append(asdict(r))
        if train_keys is None:
            train_keys = _keys(to_plain(r) for r in read_rows(dst).to_dict("records"))
    return reports


def _keys(rows) -> set:
    return {dedup_key(r["data_source"], r["prompt"]) for r in rows}


@stage(name="load-datasets", timeout_seconds=600)
def load_datasets(cfg: Config, tokenizer) -> tuple[list[dict], list[dict]]:
    """The train and eval rows, each checked as the clean stage checks them (with the policy's tokenizer) and
    with their md5 matching what DVC recorded: a bad row or a file edited behind DVC's back stops the run here,
    naming the file, row and column, before any worker or MLflow run starts."""
    rules = RowRules.from_config(cfg)
    train = validate_file(cfg.data.train_path, "data.train_path", tokenizer, rules)
    test = validate_file(cfg.data.eval_path, "data.eval_path", tokenizer, rules, _keys(train))
    verify_tracked([cfg.data.train_path, cfg.data.eval_path])
    return train, test
