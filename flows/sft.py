"""SFT flow: the supervised warm start."""

from __future__ import annotations

import sys

from prefect import flow

from components.validate import load_checked
from flows import parsers
from flows._args import check_config, run_cli
from flows._logs import one_line_errors
from tasks.caching import run_stage
from tasks.sft import run_sft


@flow(name="rl-sft")
@one_line_errors
def sft_flow(config: str = "configs/arith_grpo.yaml", overrides: list[str] | None = None) -> str:
    """Supervised warm start: build the tiny model (or load sft.base_model) and fine-tune it.

    Args:
        config: the YAML config file (configs/*.yaml), relative to the project.
        overrides: config overrides as key=value, e.g. ["algorithm.kl_loss_coef=0.04"].
    """
    return run_stage(run_sft, load_checked(config, overrides or []))


def main(argv: list[str] | None = None) -> int:
    a = parsers.sft().parse_args(argv)
    return check_config(a.config, a.overrides, a.debug) or run_cli(
        sft_flow, a.config, a.overrides, debug=a.debug, as_json=a.json
    )


if __name__ == "__main__":
    sys.exit(main())
