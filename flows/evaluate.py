"""Evaluation flow: the SFT checkpoint against the final GRPO model on the held-out split.

`python -m flows.evaluate --config configs/arith_grpo.yaml` writes metrics/eval.json (the DVC stage);
`python -m flows.evaluate --model_path DIR --eval_data FILE` scores one model.
"""

from __future__ import annotations

import sys

from prefect import flow

from components.data.io import write_json
from components.progress import progress_bar
from components.tracking import runs
from components.validate import load_checked
from flows import parsers
from flows._args import check_config, run_cli
from flows._logs import one_line_errors
from tasks.caching import run_stage
from tasks.evaluate import evaluate_model, gains, write_eval
from tasks.tracking import finished_run_info


@flow(name="rl-evaluate")
@one_line_errors
def evaluate_flow(
    config: str = "configs/arith_grpo.yaml",
    overrides: list[str] | None = None,
    output: str = "metrics/eval.json",
) -> dict:
    """Held-out accuracy (greedy acc, mean@k, pass@k) of the SFT model and of the final trained model.

    Args:
        config: the YAML config file (configs/*.yaml), relative to the project.
        overrides: config overrides as key=value, e.g. ["algorithm.kl_loss_coef=0.04"].
        output: the JSON file the metrics go to (DVC's metrics file).
    """
    cfg = load_checked(config, overrides or [])
    run = finished_run_info(cfg)  # this configuration's newest finished run in trainer.output_dir
    results: dict = {}
    with progress_bar("evaluate", 2, cfg.trainer.progress) as advance:
        for name, path, key in (
            ("sft", cfg.sft.output_dir, "sft.output_dir"),
            ("final", run["final_model"], "trainer.output_dir"),
        ):
            results[name] = run_stage(evaluate_model, path, cfg.data.eval_path, cfg, key, "data.eval_path")
            advance(info=f"{name} acc {results[name]['acc']:.3f}")
    # no wall times: DVC compares these figures across experiments and commits, and seconds are not comparable
    results["iterations"] = run.get("iterations")
    results["gain"] = gains(results["sft"], results["final"])
    write_eval(results, output, run, cfg.data.eval_path)
    return results


@flow(name="rl-evaluate-model")
@one_line_errors
def evaluate_one_flow(
    model_path: str,
    eval_data: str,
    config: str = "configs/arith_grpo.yaml",
    overrides: list[str] | None = None,
    output: str | None = None,
) -> dict:
    """Held-out accuracy of one model directory (or a training output directory: its last finished run's
    final model) on one data file; with `output`, also written there as JSON."""
    cfg = load_checked(config, overrides or [])
    result = run_stage(evaluate_model, str(runs.model_dir(model_path)), eval_data, cfg)
    if output:
        write_json({"model": str(model_path), "eval_data": eval_data, **result}, output)
    return result


def main(argv: list[str] | None = None) -> int:
    a = parsers.evaluate().parse_args(argv)
    if check_config(a.config, a.overrides, a.debug):
        return 2
    if a.model_path:  # with --eval_data: the parser said so otherwise
        return run_cli(
            evaluate_one_flow,
            a.model_path,
            a.eval_data,
            a.config,
            a.overrides,
            a.output,
            debug=a.debug,
            as_json=a.json,
        )
    output = a.output or "metrics/eval.json"
    return run_cli(evaluate_flow, a.config, a.overrides, output, debug=a.debug, as_json=a.json)


if __name__ == "__main__":
    sys.exit(main())
