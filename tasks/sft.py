"""The SFT warm-start task: build (or load) the model, fine-tune on prompt+answer, save HF format."""

from __future__ import annotations

from pathlib import Path

import torch
from prefect import task

from components.config import Config
from components.config.stages import STAGES
from components.data.clean import RowRules, validate_file
from components.data.images import ImageEncoder, absolute_images
from components.errors import DataError
from components.models import load_model, save_pretrained
from components.models.loading import load_image_encoder
from components.models.multimodal import compose_policy
from components.models.tiny import tiny_model_for
from components.outputs import SFT_MODEL, check_output
from components.progress import progress_bar
from components.seeding import seed_everything
from components.settings import PromptSettings
from components.training.optim import freeze_vision, param_groups
from components.training.sft import SFTExample, encode_examples, train_sft
from tasks.caching import StageCache, cached_stage
from tasks.common import logger
from tasks.data import sft_tokenizer

SFT_CACHE = StageCache(
    config_keys=STAGES["sft"].reads,
    reads=lambda i: (
        [i["cfg"].data.train_path] + ([i["cfg"].sft.base_model] if i["cfg"].sft.base_model else [])
    ),
    writes=lambda i: [str(Path(i["cfg"].sft.output_dir) / "config.json")],
)


def check_examples(examples: list[SFTExample], answers: list[str], max_seq_len: int, path: str) -> None:
    """Every row has an answer to learn (extra_info.answer) and fits actor.model.max_seq_len; DataError naming
    the first rows that do not."""
    empty = [i for i, a in enumerate(answers) if not a.strip()]
    long = [
        (i, len(e.prompt_ids) + len(e.answer_ids))
        for i, e in enumerate(examples)
        if len(e.prompt_ids) + len(e.answer_ids) > max_seq_len
    ]
    if empty:
        raise DataError(
            f"data.train_path={path}: {len(empty)} rows have no answer to train on (column "
            f"extra_info.answer), the first: row {empty[0]}. SFT needs an answer per row; give them, "
            "or skip SFT and train from a model that needs none (actor.model.path)."
        )
    if long:
        raise DataError(
            f"data.train_path={path}: {len(long)} rows are longer than actor.model.max_seq_len="
            f"{max_seq_len} tokens (prompt + answer), the first: row {long[0][0]} with {long[0][1]}. "
            "Raise actor.model.max_seq_len, or shorten those answers."
        )


@task(name="sft", timeout_seconds=3600, **cached_stage(SFT_CACHE))
def run_sft(cfg: Config) -> str:
    s, path = cfg.sft, cfg.data.train_path
    check_output(s.output_dir, "sft.output_dir", SFT_MODEL, cfg.trainer.run_dir)  # before any work
    tok = sft_tokenizer(cfg)
    seed_everything(cfg.trainer.seed)
    torch.set_num_threads(cfg.trainer.num_threads)
    model, images = None, None
    if s.base_model:
        trust = cfg.actor.model.trust_remote_code
        model = load_model(s.base_model, key="sft.base_model", trust_remote_code=trust)
        images = load_image_encoder(s.base_model, tok, "sft.base_model", trust)
    elif cfg.actor.model.type == "multimodal":
        model, processor = compose_policy(cfg, tok, cfg.trainer.seed)
        images = ImageEncoder(processor, model.config.image_tokens)
    rules = RowRules.from_config(cfg, images.image_tokens if images else None)
    rows = absolute_images(validate_file(path, "data.train_path", tok, rules), Path.cwd())
    answers = [r["extra_info"]["answer"] for r in rows]
    prompts = [r["prompt"] for r in rows]
    examples = encode_examples(
        tok,
        prompts,
        answers,
        PromptSettings.from_config(cfg),
        images,
        rows,
        cfg.multi_turn.max_tool_response_chars,
    )
    check_examples(examples, answers, cfg.actor.model.max_seq_len, path)
    if model is None:
        model = tiny_model_for(s, cfg.actor.model.max_seq_len, tok, cfg.trainer.seed)
    freeze_vision(model, cfg.actor.model)
    with progress_bar("sft", s.steps, cfg.trainer.progress) as advance:
        losses = train_sft(
            model,
            examples,
            steps=s.steps,
            batch_size=s.batch_size,
            lr=s.lr,
            pad_id=tok.pad_token_id,
            seed=cfg.trainer.seed,
            final_lr_frac=s.final_lr_frac,
            params=param_groups(model, s.lr, cfg.actor.model),
            on_step=lambda step, loss: advance(info=f"loss {loss:.3f}"),
        )
    out = save_pretrained(
        model, tok, Path(s.output_dir), kind=SFT_MODEL, processor=images.processor if images else None
    )
    logger().info(
        "SFT: %d steps, final loss %.4f, saved to %s", s.steps, losses[-1] if losses else float("nan"), out
    )
    return str(out)
