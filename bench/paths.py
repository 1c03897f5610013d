"""The default pipeline with every data and output path under one directory: how the benchmarks and the tests
run it beside a checkout without touching the checkout's own data, models or runs."""

from __future__ import annotations

from pathlib import Path


def paths_under(root: str | Path, output: str = "grpo") -> list[str]:
    """Overrides that put the pipeline's raw and clean data, quarantine, SFT model and training output (in
    `root`/`output`) under `root`, which is also the run directory every path must stay inside."""
    return [
        f"trainer.run_dir={root}",
        f"data.raw_dir={root}/raw",
        f"data.train_path={root}/clean/train.parquet",
        f"data.eval_path={root}/clean/test.parquet",
        f"data.quarantine_dir={root}/quarantine",
        f"sft.output_dir={root}/sft",
        f"actor.model.path={root}/sft",
        f"trainer.output_dir={root}/{output}",
    ]
