"""Data flow: prepare (generate or import) then clean."""

from __future__ import annotations

import sys

from prefect import flow

from components.config import load_config
from flows._args import check_config, config_parser, run_cli
from tasks.caching import run_stage
from tasks.data import clean_data, prepare_data


@flow(name="rl-data")
def data_flow(
    config: str = "configs/arith_grpo.yaml",
    overrides: list[str] | None = None,
    steps: tuple[str, ...] = ("prepare", "clean"),
) -> dict:
    cfg = load_config(config, overrides or [])
    out: dict = {}
    if "prepare" in steps:
        out["raw"] = run_stage(prepare_data, cfg)
    if "clean" in steps:
        out["clean"] = run_stage(clean_data, cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    p = config_parser("Prepare and clean the datasets.", "reinforge data")
    p.add_argument("--step", choices=["prepare", "clean", "all"], default="all")
    a = p.parse_args(argv)
    steps = ("prepare", "clean") if a.step == "all" else (a.step,)
    return check_config(a.config, a.overrides, a.debug) or run_cli(
        data_flow, a.config, a.overrides, steps, debug=a.debug
    )


if __name__ == "__main__":
    sys.exit(main())
