"""A training process's start-up: process start -> first rollout, by phase, for `reinforge train` (Prefect's
server and Ray started while the flow's modules import; the workers start while the inputs are checked)
against `python -m flows.train` (the same flow, the services started when it needs them), alternated,
medians of the timing_s/startup/* metrics each run logs to MLflow; and where the machine's CPU went until the
first rollout, by process (the driver, Prefect's server, Ray's own services, Ray's workers), sampled from the
process tree: on a machine whose cores are busy all through the start-up, their sum over the cores is the
least wall time that start-up can take without cutting work.

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

import psutil

from bench.memory import BackgroundSampler

PHASES = ("imports", "prefect", "setup", "workers", "first_gen")
# which part of the start-up a process is, by its command line, first match wins; the process started is
# "driver", any other "other"
ROLES = (
    ("prefect.server", "prefect server"),
    ("ray::DashboardAgent", "ray services"),
    ("ray::RuntimeEnvAgent", "ray services"),
    ("ray::", "ray workers"),  # an actor's process, named after its class
    ("default_worker.py", "ray workers"),  # an idle (warmed) worker
    ("/ray/", "ray services"),  # gcs_server, raylet, the monitors, the minimal dashboard
)
ROLE_COLUMNS = ("driver", "prefect server", "ray services", "ray workers", "other")


def role_of(cmdline: str) -> str:
    return next((role for part, role in ROLES if part in cmdline), "other")


class TreeTimeline(BackgroundSampler):
    """The cumulative CPU seconds (user + system) of a process and each of its descendants, sampled every
    `interval_s` in a thread while the `with` block runs: samples[i] = (time.time(), {pid: (role, cpu_s)}),
    a descendant's role `role(its command line)`, the process's own `root`. The same walk reads their RSS:
    `peak_rss` is the highest sum seen and `rss_at_peak` its split by role at that sample (which role held
    the memory when the run held the most)."""

    def __init__(self, pid: int, interval_s: float = 0.2, role=role_of, root: str = "driver"):
        self.root, self.interval_s = psutil.Process(pid), interval_s
        self.role, self.root_role = role, root
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self.peak_rss, self.rss_at_peak = 0, {}

    def sample(self) -> None:
        now, seen, rss = time.time(), {}, {}
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:  # the run has ended
            return
        for proc in procs:
            try:
                t, held = proc.cpu_times(), proc.memory_info().rss
                role = self.root_role if proc.pid == self.root.pid else self.role(" ".join(proc.cmdline()))
            except psutil.Error:  # ended since the listing
                continue
            seen[proc.pid] = (role, t.user + t.system)
            rss[role] = rss.get(role, 0) + held
        self.samples.append((now, seen))
        if (total := sum(rss.values())) > self.peak_rss:
            self.peak_rss, self.rss_at_peak = total, rss


def cpu_by_role(samples: list[tuple[float, dict[int, tuple[str, float]]]], until: float) -> dict[str, float]:
    """CPU seconds each role had used by `until` (time.time()): each process's last sample before it, summed
    by role (the role it had then: a warmed worker becomes its actor). A process's CPU after its last sample
    (up to `interval_s` of it) is not counted."""
    last: dict[int, tuple[str, float]] = {}
    for at, seen in samples:
        if at > until:
            break
        last.update(seen)
    out: dict[str, float] = {}
    for role, cpu in last.values():
        out[role] = out.get(role, 0.0) + cpu
    return out


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
    proc = subprocess.Popen(
        [*cmd, *OVERRIDES, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
    )
    with TreeTimeline(proc.pid) as cpu:
        out, err = proc.communicate(timeout=600)
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    run_id = json.loads(out[out.index("{") :])["run_id"]
    metrics = MlflowClient(default_tracking_uri()).get_run(run_id).data.metrics
    phases = {p: metrics[f"timing_s/startup/{p}"] for p in PHASES}
    first_gen = started + phases["first_gen"]  # Popen's instant stands for the process's start
    used = cpu_by_role(cpu.samples, first_gen)
    return phases | {"process_wall": wall} | {f"cpu:{r}": used.get(r, 0.0) for r in ROLE_COLUMNS}


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
    cores = len(os.sched_getaffinity(0))
    print(f"\nmedian CPU seconds until the first rollout, by process ({cores} cores)")
    print(f"{'':<{width}}" + "".join(f"{c:>16}" for c in (*ROLE_COLUMNS, "total", "total / cores")))
    for name, runs in results.items():
        used = {c: statistics.median(r[f"cpu:{c}"] for r in runs) for c in ROLE_COLUMNS}
        total = statistics.median(sum(r[f"cpu:{c}"] for c in ROLE_COLUMNS) for r in runs)
        figures = (*used.values(), total, total / cores)
        print(f"{name:<{width}}" + "".join(f"{v:>16.2f}" for v in figures))


if __name__ == "__main__":
    main()
