"""Train a tiny reward model for the arithmetic task (no downloads), for `reward_model.path`."""

from __future__ import annotations

import sys

from prefect import flow

from components.config import load_config
from flows._args import check_config, config_parser, run_cli
from tasks.reward_model import fit_reward_model


@flow(name="rl-reward-model")
def reward_model_flow(
    config: str = "configs/arith_grpo.yaml",
    overrides: list[str] | None = None,
    out: str = "checkpoints/rm",
    steps: int = 150,
    batch_size: int = 64,
    lr: float = 3e-4,
) -> dict[str, float]:
    return fit_reward_model(load_config(config, overrides or []), out, steps, batch_size, lr)


def main(argv: list[str] | None = None) -> int:
    p = config_parser(
        "Train a reward model on preference pairs from the arithmetic task (right answer vs a "
        "near miss), starting from the SFT model; then train with reward_model.path=<out>.",
        "reinforge reward-model",
    )
    p.add_argument(
        "--out", default="checkpoints/rm", help="where the reward model is saved (default: %(default)s)"
    )
    p.add_argument("--steps", type=int, default=150, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="pairs per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default: %(default)s)")
    a = p.parse_args(argv)
    return check_config(a.config, a.overrides, a.debug) or run_cli(
        reward_model_flow, a.config, a.overrides, a.out, a.steps, a.batch_size, a.lr, debug=a.debug
    )


if __name__ == "__main__":
    sys.exit(main())
