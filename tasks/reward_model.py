"""The reward-model training task: preference pairs from the arithmetic task, Bradley-Terry fit, HF save."""

from __future__ import annotations

from prefect import task

from components.config import Config
from components.config.checks import escape_problem
from components.data.clean import RowRules, validate_file
from components.errors import ConfigError, DataError
from components.models.loading import load_tokenizer
from components.outputs import REWARD_MODEL, check_output
from components.progress import progress_bar
from components.rewards.reward_model import (
    arith_preference_pairs,
    load_reward_model,
    pair_accuracy,
    train_reward_model,
)
from components.seeding import seed_everything
from components.settings import PromptSettings
from tasks.common import logger


@task(name="train-reward-model", timeout_seconds=3600)
def fit_reward_model(cfg: Config, out: str, steps: int, batch_size: int, lr: float) -> dict[str, float]:
    """Train on pairs from data.train_path starting from the SFT model; held-out pair accuracy on
    data.eval_path."""
    import torch

    escaped = escape_problem("--out", out, cfg.trainer.run_dir, output_dir=True)
    if escaped:
        raise ConfigError(escaped)
    check_output(
        out, "--out", REWARD_MODEL, cfg.trainer.run_dir
    )  # before any work: never a foreign directory
    seed_everything(cfg.trainer.seed)
    torch.set_num_threads(cfg.trainer.num_threads)
    init = cfg.sft.output_dir
    tok, rules, settings = (
        load_tokenizer(init, "sft.output_dir", cfg.actor.model.trust_remote_code),
        RowRules.from_config(cfg),
        PromptSettings.from_config(cfg),
    )
    train = validate_file(cfg.data.train_path, "data.train_path", tok, rules)
    test = validate_file(cfg.data.eval_path, "data.eval_path", tok, rules)
    for key, rows in (("data.train_path", train), ("data.eval_path", test)):
        bad = next(
            (i for i, r in enumerate(rows) if not r["reward_model"]["ground_truth"].lstrip("-").isdigit()),
            None,
        )
        if bad is not None:
            raise DataError(
                f"{key}: row {bad} has ground truth {rows[bad]['reward_model']['ground_truth']!r}; the "
                "reward-model trainer makes its preference pairs from integer answers (the arithmetic "
                "task). Train a reward model for other data yourself and set reward_model.path."
            )
    with progress_bar("reward model", steps, cfg.trainer.progress) as advance:
        result = train_reward_model(
            init,
            arith_preference_pairs(train, tok, cfg.trainer.seed, settings=settings),
            out,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=cfg.trainer.seed,
            on_step=lambda step, loss: advance(info=f"loss {loss:.3f}"),
        )
    rm_tok, model = load_reward_model(out, key="--out")
    heldout = arith_preference_pairs(test, tok, cfg.trainer.seed + 1, settings=settings)
    result["heldout_pair_accuracy"] = pair_accuracy(model, rm_tok, heldout)
    logger().info("reward model saved to %s: %s", out, result)
    return result
