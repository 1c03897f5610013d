"""A training process's start-up: process start -> first rollout, by phase, for `reinforge train` (Prefect's
server and Ray started while the flow's modules import; the workers start while the inputs are checked)
against `python -m flows.train` (the same flow, the services started when it needs them), alternated,
medians of the timing_s/startup/* metrics each run logs to MLflow.

    python -m bench.startup               # 3 runs of each, 1 iteration each, on the default config
    python -m bench.startup --reps 5
    python -m bench.startup --against ../old  # also `reinforge train` of another checkout (git worktree add)

Needs the default pipeline's SFT model and data (`make run`, or `dvc repro dvc.yaml`). The runs train into
checkpoints/bench_startup and log to the project's MLflow store (experiment bench-startup).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("imports", "prefect", "setup", "workers", "first_gen")
ENTRIES = {
    "reinforge train": [sys.executable, "-m", "flows.cli", "train"],
    "python -m flows.train": [sys.executable, "-m", "flows.train"],
}
OVERRIDES = [
    "trainer.iterations=1",
    "trainer.output_dir=checkpoints/bench_startup",
    "trainer.when_finished=retrain",
    "trainer.test_interval=100",
    "trainer.save_interval=100",
    "trainer.experiment_name=bench-startup",
    "trainer.progress=false",
]


def one_run(cmd: list[str], cwd: str | None = None) -> dict[str, float]:
    """One run of `cmd` in `cwd` (another checkout: `python -m` imports its modules first), its phases from
    the metrics it logged to this project's MLflow store."""
    from mlflow.tracking import MlflowClient

    from components.tracking.mlflow_tracker import default_tracking_uri

    env = {**os.environ, "MLFLOW_TRACKING_URI": default_tracking_uri()}
    started = time.time()
    res = subprocess.run(
        [*cmd, *OVERRIDES, "--json"], capture_output=True, text=True, timeout=600, cwd=cwd, env=env
    )
    wall = time.time() - started
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    run_id = json.loads(res.stdout[res.stdout.index("{") :])["run_id"]
    metrics = MlflowClient(default_tracking_uri()).get_run(run_id).data.metrics
    return {p: metrics[f"timing_s/startup/{p}"] for p in PHASES} | {"process_wall": wall}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="runs of each entry point, alternated")
    p.add_argument(
        "--against", help="another checkout (a git worktree): its `reinforge train` alternates too"
    )
    a = p.parse_args(argv)
    entries = {name: (cmd, None) for name, cmd in ENTRIES.items()}
    if (
        a.against
    ):  # its data and SFT model are copies of this checkout's: the same inputs, only the code differs
        root = Path(a.against).resolve()
        for shared in ("data", "checkpoints/sft"):
            if not (root / shared).exists():
                shutil.copytree(shared, root / shared)
        entries[f"reinforge train ({root.name})"] = (ENTRIES["reinforge train"], str(root))
    results: dict[str, list[dict]] = {name: [] for name in entries}
    for _ in range(a.reps):
        for name, (cmd, cwd) in entries.items():
            results[name].append(one_run(cmd, cwd))
    columns = (*PHASES, "process_wall")
    width = max(24, *(len(n) + 2 for n in results))
    print(f"{'median seconds':<{width}}" + "".join(f"{c:>13}" for c in columns))
    medians = {
        name: {c: statistics.median(r[c] for r in runs) for c in columns} for name, runs in results.items()
    }
    for name, m in medians.items():
        print(f"{name:<{width}}" + "".join(f"{m[c]:>13.2f}" for c in columns))
    ours, plain = medians["reinforge train"], medians["python -m flows.train"]
    ratio = ours["first_gen"] / plain["first_gen"]
    print(f"first rollout: {ours['first_gen']:.2f} s vs {plain['first_gen']:.2f} s ({ratio:.2f}x)")
    for name in results.keys() - ENTRIES.keys():
        other = medians[name]["first_gen"]
        print(
            f"against {name}: {ours['first_gen']:.2f} s vs {other:.2f} s ({ours['first_gen'] / other:.2f}x)"
        )


if __name__ == "__main__":
    main()
