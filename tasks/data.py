"""Data tasks: generate or import raw rows, clean them into the train/eval files, and load them for a flow."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from prefect import task

from components.config import Config
from components.config.checks import check_contained
from components.config.stages import STAGES
from components.data.clean import RowRules, clean_file, row_key, validate_file
from components.data.formats import ROW_SCHEMA, arithmetic_rows, gsm8k_splits, row_schema
from components.data.images import absolute_images, llava_rows, visual_count_rows
from components.data.io import read_rows, to_plain, write_parquet
from components.errors import ConfigError, DataError
from components.lineage import verify_tracked
from tasks.caching import StageCache, cached_stage
from tasks.common import logger, stage


def raw_file(raw_dir: str | Path, split: str) -> Path:
    """data.raw_dir's file of a split (train, test): `<split>.parquet`, or a user's `<split>.jsonl` when only
    that is there (docs/data.md)."""
    parquet, jsonl = Path(raw_dir) / f"{split}.parquet", Path(raw_dir) / f"{split}.jsonl"
    return jsonl if jsonl.exists() and not parquet.exists() else parquet


def _raw_files(inputs: dict) -> list[str]:
    raw = inputs["cfg"].data.raw_dir
    return [str(raw_file(raw, "train")), str(raw_file(raw, "test"))]


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
    """The tokenizer at `source`, or the one SFT will build: the tiny model's (with the tool-call tokens for
    multi-turn runs), or for a VLM that SFT composes, actor.model.text_model's; either with `<image>` added."""
    # tokenizers import transformers and torch (~4 s): here, where the clean stage needs one, not at the import
    # of this module, which `reinforge prepare` imports too
    from components.models.loading import load_tokenizer
    from components.models.tiny import build_char_tokenizer

    composing = cfg.actor.model.type == "multimodal" and source is None
    if composing:  # the VLM modules import transformers' modeling code: text-only runs never load it
        from components.models.vlm import with_image_token
    if source is None and composing and cfg.actor.model.text_model:
        source = ("actor.model.text_model", cfg.actor.model.text_model)
    if source is None:
        tok = build_char_tokenizer(tool_tokens=cfg.multi_turn.enable or cfg.data.task == "arith_tool")
    else:
        key, path = source
        tok = load_tokenizer(path, key, cfg.actor.model.trust_remote_code)
    return with_image_token(tok) if composing else tok


def data_image_tokens(cfg: Config) -> int | None:
    """Tokens each `<image>` of a prompt becomes for the policy the data is cleaned for: its processor's
    expansion (a VLM directory), the composed model's (multimodal SFT), or None for a text-only policy."""
    if cfg.actor.model.type != "multimodal":
        return None
    source = tokenizer_source(cfg)
    if source is None:
        from components.models.multimodal import composed_image_tokens

        return composed_image_tokens(cfg)
    from components.models.loading import load_image_encoder, load_tokenizer

    key, path = source
    trust = cfg.actor.model.trust_remote_code
    encoder = load_image_encoder(path, load_tokenizer(path, key, trust), key, trust)
    if encoder is None:
        raise ConfigError(
            f"{key}={path} is a text-only model, but actor.model.type=multimodal; point it at a "
            "vision-language model directory, or leave sft.base_model unset to compose one."
        )
    return encoder.image_tokens


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
    """Write data.raw_dir/{train,test}.parquet: the arithmetic task, reasoning-gym's tasks, a TextArena game's
    demonstrations and held-out games (multi_turn.game), or an import of data.gsm8k_path (with
    data.gsm8k_test_path, or a seeded held-out split of it)."""
    d = cfg.data
    check_contained(cfg, "data.raw_dir")  # what it writes (clean only reads it)
    raw = Path(d.raw_dir)
    schema = ROW_SCHEMA
    if d.task == "visual_count" or d.llava_path:
        train, test = visual_rows(cfg)
        schema = row_schema("text", images=True)
    elif d.gsm8k_path:
        train, test = gsm8k_splits(d.gsm8k_path, d.gsm8k_test_path, d.num_eval, cfg.trainer.seed)
    elif d.task == "textarena":
        from components.data import games

        mt = cfg.multi_turn
        train, test = games.rows(mt.game, d.num_train, d.num_eval, mt.max_turns, cfg.trainer.seed)
        schema = row_schema("messages", env_seed=True)
    elif d.task == "reasoning_gym":
        from components.data import reasoning_gym

        train, test = reasoning_gym.rows(d.reasoning_gym, d.num_train, d.num_eval, cfg.trainer.seed)
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
        write_parquet(rows, raw / name, schema)
        for rows, name in ((train, "train.parquet"), (test, "test.parquet"))
    ]
    logger().info("prepared %d train and %d test rows in %s", len(train), len(test), raw)
    return [str(p) for p in paths]


def visual_rows(cfg: Config) -> tuple[list[dict], list[dict]]:
    """The visual counting task's rows, images written as PNG under data.raw_dir/images; or an import of the
    LLaVA jsonl data.llava_path with data.num_eval seeded rows held out."""
    import random

    d = cfg.data
    if not d.llava_path:
        images = Path(d.raw_dir) / "images"
        size = d.image_processor.size
        return visual_count_rows(d.num_train, d.num_eval, d.max_count, images, size, cfg.trainer.seed)
    rows = llava_rows(d.llava_path, d.llava_image_folder)
    if d.num_eval >= len(rows):
        raise DataError(
            f"data.llava_path={d.llava_path} has {len(rows)} rows, too few to hold out data.num_eval="
            f"{d.num_eval}; lower data.num_eval."
        )
    order = list(range(len(rows)))
    random.Random(cfg.trainer.seed).shuffle(order)
    held = set(order[: d.num_eval])
    test = [
        {**r, "extra_info": {**r["extra_info"], "split": "test"}} for i, r in enumerate(rows) if i in held
    ]
    return [r for i, r in enumerate(rows) if i not in held], test


@task(name="clean-data", timeout_seconds=600, **cached_stage(CLEAN_CACHE))
def clean_data(cfg: Config) -> list[dict]:
    """Validate raw rows; write clean files and quarantine files (with reasons); log the counts. Held-out
    rows whose prompt is a training prompt are quarantined (`in_train`)."""
    d = cfg.data
    tokenizer, rules = data_tokenizer(cfg), RowRules.from_config(cfg, data_image_tokens(cfg))
    check_contained(cfg, "data.train_path", "data.eval_path")  # what it writes (a run only reads them)
    reports, train_keys = [], None
    for src, dst in (
        (raw_file(d.raw_dir, "train"), d.train_path),
        (raw_file(d.raw_dir, "test"), d.eval_path),
    ):
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
    return {row_key(r) for r in rows}


@stage(name="load-datasets", timeout_seconds=600)
def load_datasets(cfg: Config, tokenizer) -> tuple[list[dict], list[dict]]:
    """The train and eval rows, each checked as the clean stage checks them (with the policy's tokenizer) and
    with their md5 matching what DVC recorded: a bad row or a file edited behind DVC's back stops the run here,
    naming the file, row and column, before any worker or MLflow run starts."""
    from components.models.loading import load_image_encoder

    encoder = load_image_encoder(
        cfg.actor.model.path, tokenizer, trust_remote_code=cfg.actor.model.trust_remote_code
    )
    rules = RowRules.from_config(cfg, encoder.image_tokens if encoder else None)
    train = validate_file(cfg.data.train_path, "data.train_path", tokenizer, rules)
    test = validate_file(cfg.data.eval_path, "data.eval_path", tokenizer, rules, _keys(train))
    verify_tracked([cfg.data.train_path, cfg.data.eval_path])
    # image paths made absolute: Ray workers need not share the driver's working directory
    return absolute_images(train, Path.cwd()), absolute_images(test, Path.cwd())
