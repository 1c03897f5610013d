"""The reward-model training task: preference pairs from the arithmetic task, Bradley-Terry fit, HF save."""

from __future__ import annotations

from prefect import task

from components.config import Config
from components.data.io import read_rows
from components.models.loading import load_tokenizer
from components.progress import progress_bar
from components.rewards.reward_model import arith_preference_pairs, load_reward_model, pair_accuracy, \
    train_reward_model
from components.training.seeding import seed_everything
from tasks.common import logger


@task(name="train-reward-model", timeout_seconds=3600)
def fit_reward_model(cfg: Config, out: str, steps: int, batch_size: int, lr: float) -> dict[str, float]:
    """Train on pairs from data.train_path starting from the SFT model; held-out pair accuracy on
    data.eval_path."""
    import torch

    seed_everything(cfg.trainer.seed)
    torch.set_num_threads(cfg.trainer.num_threads)
    init = cfg.sft.output_dir
    tok = load_tokenizer(init, "sft.output_dir")
    train = read_rows(cfg.data.train_path, key="data.train_path").to_dict("records")
    test = read_rows(cfg.data.eval_path, key="data.eval_path").to_dict("records")
    with progress_bar("reward model", steps, cfg.trainer.progress) as advance:
        result = train_reward_model(init, arith_preference_pairs(train, tok, cfg.trainer.seed), out, steps=steps,
                                    batch_size=batch_size, lr=lr, seed=cfg.trainer.seed,
                                    on_step=lambda step, loss: advance(info=f"loss {loss:.3f}"))
    rm_tok, model = load_reward_model(out, key="--out")
    result["heldout_pair_accuracy"] = pair_accuracy(model, rm_tok, arith_preference_pairs(test, tok,
                                                                                           cfg.trainer.seed + 1))
    logger().info("reward model saved to %s: %s", out, result)
    return result
