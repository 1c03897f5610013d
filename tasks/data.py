"""Data tasks: generate or import raw rows, then clean them into the train/eval files."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks.caching import StageCache, cached_stage
from tasks.common import logger

from components.config import Config
from dataclasses import asdict

from components.data.clean import clean_file
from components.data.formats import ROW_SCHEMA, arithmetic_rows, gsm8k_rows
from components.data.io import to_plain, write_parquet
from components.models.tiny import build_char_tokenizer


def _raw_files(inputs: dict) -> list[str]:
    raw = Path(inputs["cfg"].data.raw_dir)
    return [str(raw / "train.parquet"), str(raw / "test.parquet")]


def _clean_outputs(inputs: dict) -> list[str]:
    d = inputs["cfg"].data
    return [d.train_path, d.eval_path]


PREPARE_CACHE = StageCache(config_keys=("data", "trainer.seed"), reads=lambda i: [p for p in [i["cfg"].data.gsm8k_path] if p],
                           writes=_raw_files)
CLEAN_CACHE = StageCache(config_keys=("data", "sft.base_model"), reads=_raw_files, writes=_clean_outputs)


@task(name="prepare-data", timeout_seconds=600, **cached_stage(PREPARE_CACHE))
def prepare_data(cfg: Config) -> list[str]:
    """Write data.raw_dir/{train,test}.parquet: the arithmetic task, or an import of data.gsm8k_path."""
    d = cfg.data
    raw = Path(d.raw_dir)
    if d.gsm8k_path:
        train, test = gsm8k_rows(d.gsm8k_path, "train"), gsm8k_rows(d.gsm8k_path, "test")
    else:
        train, test = arithmetic_rows(d.num_train, d.num_eval, d.max_operand, d.operations, cfg.trainer.seed,
                                      d.tool_sft_fraction if d.task == "arith_tool" else None)
    paths = [write_parquet(train, raw / "train.parquet", ROW_SCHEMA), write_parquet(test, raw / "test.parquet",
                                                                                   ROW_SCHEMA)]
    logger().info("prepared %d train and %d test rows in %s", len(train), len(test), raw)
    return [str(p) for p in paths]


def _token_counter(cfg: Config):
    """Counts prompt tokens with the policy's tokenizer if one exists yet, else the tiny character one."""
    from components.models.loading import load_tokenizer

    base = cfg.sft.base_model
    tok = load_tokenizer(base, key="sft.base_model") if base else build_char_tokenizer()
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


@task(name="clean-data", timeout_seconds=600, **cached_stage(CLEAN_CACHE))
def clean_data(cfg: Config) -> list[dict]:
    """Validate raw rows; write clean files and quarantine files (with reasons); log the counts."""
    d = cfg.data
    count = _token_counter(cfg)
    reports = []
    for src, dst in ((Path(d.raw_dir) / "train.parquet", d.train_path), (Path(d.raw_dir) / "test.parquet",
                                                                        d.eval_path)):
        r = clean_file(src, dst, d.quarantine_dir, count, d.max_prompt_len)
        logger().info("%s: %d rows in, %d kept, %d quarantined %s -> %s", src, r.input_rows, r.kept,
                              r.quarantined, r.reasons or "", r.quarantine_path)
        reports.append(asdict(r))
    return reports


@task(name="load-datasets", timeout_seconds=600)
def load_datasets(cfg: Config) -> tuple[list[dict], list[dict]]:
    """The cleaned train and eval rows as plain dicts, once their md5 matches what DVC recorded (a file
    edited behind DVC's back stops the run here, naming it, before anything is trained)."""
    from components.data.io import read_rows
    from components.errors import DataError
    from components.lineage import verify_tracked

    out = []
    for key, path in (("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)):
        rows = read_rows(path, key=key)  # a missing file: DataError naming the key
        verify_tracked([path])
        rows = rows.to_dict("records")
        if not rows:
            raise DataError(f"{key}: {path} has no rows; run `reinforge clean` and check the quarantine folder")
        out.append([to_plain(r) for r in rows])
    return out[0], out[1]
