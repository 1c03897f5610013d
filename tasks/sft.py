"""The SFT warm-start task: build (or load) the model, fine-tune on prompt+answer, save HF format."""

from __future__ import annotations

from pathlib import Path

import torch
from prefect import task

from tasks.caching import StageCache, cached_stage
from tasks.common import logger

from components.config import Config
from components.data.io import read_rows
from components.models import build_char_tokenizer, build_tiny_model, load_model, load_tokenizer, save_pretrained
from components.progress import progress_bar
from components.training.seeding import seed_everything
from components.training.sft import encode_examples, train_sft


SFT_CACHE = StageCache(config_keys=("sft", "actor.model.max_seq_len", "trainer.seed"),
                       reads=lambda i: [i["cfg"].data.train_path] + ([i["cfg"].sft.base_model] if i["cfg"].sft.base_model
                                                                     else []),
                       writes=lambda i: [str(Path(i["cfg"].sft.output_dir) / "config.json")])


@task(name="sft", timeout_seconds=3600, **cached_stage(SFT_CACHE))
def run_sft(cfg: Config) -> str:
    seed_everything(cfg.trainer.seed)
    torch.set_num_threads(cfg.trainer.num_threads)
    s = cfg.sft
    if s.base_model:
        tok, model = load_tokenizer(s.base_model, "sft.base_model"), load_model(s.base_model, key="sft.base_model")
    else:
        tok = build_char_tokenizer(tool_tokens=cfg.multi_turn.enable or cfg.data.task == "arith_tool")
        model = build_tiny_model(tok, hidden_size=s.hidden_size, num_layers=s.num_layers, num_heads=s.num_heads,
                                 intermediate_size=s.intermediate_size, max_positions=cfg.actor.model.max_seq_len,
                                 seed=cfg.trainer.seed)
    rows = read_rows(cfg.data.train_path, key="data.train_path").to_dict("records")
    examples = encode_examples(tok, [list(r["prompt"]) for r in rows], [r["extra_info"]["answer"] for r in rows])
    with progress_bar("sft", s.steps, cfg.trainer.progress) as advance:
        losses = train_sft(model, examples, steps=s.steps, batch_size=s.batch_size, lr=s.lr,
                           pad_id=tok.pad_token_id, seed=cfg.trainer.seed, final_lr_frac=s.final_lr_frac,
                           on_step=lambda step, loss: advance(info=f"loss {loss:.3f}"))
    out = save_pretrained(model, tok, Path(s.output_dir))
    logger().info("SFT: %d steps, final loss %.4f, saved to %s", s.steps, losses[-1] if losses else
                          float("nan"), out)
    return str(out)
