"""Data flow: prepare (generate or import) then clean."""

from __future__ import annotations

import sys

from prefect import flow

from components.validate import load_checked
from flows import parsers
from flows._args import check_config, run_cli
from flows._logs import one_line_errors
from tasks.caching import run_stage
from tasks.data import clean_data, prepare_data


@flow(name="rl-data")
@one_line_errors
def data_flow(
    config: str = "configs/arith_grpo.yaml",
    overrides: list[str] | None = None,
    steps: tuple[str, ...] = ("prepare", "clean"),
) -> dict:
    """Prepare (generate, or import GSM8K / LLaVA files) then clean the datasets; bad rows are quarantined.

    Args:
        config: the YAML config file (configs/*.yaml), relative to the project.
        overrides: config overrides as key=value, e.g. ["algorithm.kl_loss_coef=0.04"].
        steps: which steps run, in order: "prepare", "clean".
    """
    cfg = load_checked(config, overrides or [])
    out: dict = {}
    if "prepare" in steps:
        out["raw"] = run_stage(prepare_data, cfg)
    if "clean" in steps:
        out["clean"] = run_stage(clean_data, cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parsers.data().parse_args(argv)
    steps = ("prepare", "clean") if a.step == "all" else (a.step,)
    return check_config(a.config, a.overrides, a.debug) or run_cli(
        data_flow, a.config, a.overrides, steps, debug=a.debug, as_json=a.json
    )


if __name__ == "__main__":
    sys.exit(main())
