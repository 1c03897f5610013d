"""Train a tiny reward model for the arithmetic task (no downloads), for `reward_model.path`."""

from __future__ import annotations

import sys

from prefect import flow

from components.validate import load_checked
from flows import parsers
from flows._args import check_config, run_cli
from flows._logs import one_line_errors
from tasks.reward_model import fit_reward_model


@flow(name="rl-reward-model")
@one_line_errors
def reward_model_flow(
    config: str = "configs/arith_grpo.yaml",
    overrides: list[str] | None = None,
    out: str = "checkpoints/rm",
    steps: int = 150,
    batch_size: int = 64,
    lr: float = 3e-4,
) -> dict[str, float]:
    """Train a reward model on arithmetic preference pairs, starting from the SFT model.

    Args:
        config: the YAML config file (configs/*.yaml), relative to the project.
        overrides: config overrides as key=value, e.g. ["algorithm.kl_loss_coef=0.04"].
        out: where the reward model is saved.
        steps: optimizer steps.
        batch_size: preference pairs per step.
        lr: AdamW learning rate.
    """
    return fit_reward_model(load_checked(config, overrides or []), out, steps, batch_size, lr)


def main(argv: list[str] | None = None) -> int:
    a = parsers.reward_model().parse_args(argv)
    return check_config(a.config, a.overrides, a.debug) or run_cli(
        reward_model_flow,
        a.config,
        a.overrides,
        a.out,
        a.steps,
        a.batch_size,
        a.lr,
        debug=a.debug,
        as_json=a.json,
    )


if __name__ == "__main__":
    sys.exit(main())
