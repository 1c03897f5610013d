"""Where the test suite's CPU goes: pytest (with the project's own settings: two processes, the whole suite)
runs with its process tree sampled every second, then the CPU seconds by kind of process print: pytest's own
processes, Ray's workers by actor class, Ray's services, Prefect's and MLflow's servers, DVC, the sandboxes,
the `reinforge` and flow processes the tests start; with the machine's busy and idle CPU over the run. On a
2-core machine whose cores are busy nearly all through, only less CPU per test makes the suite shorter
(docs/benchmarks.md, "The test suite").

    python -m bench.suite_cpu                       # the whole suite, as `make test` runs it
    python -m bench.suite_cpu -- tests/flows -x     # pytest's arguments after --
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil

from bench.startup import TreeTimeline, cpu_by_role

# a process's kind by its command line, first match wins (an actor's process is named ray::<Class>.<method>)
KINDS = (
    ("ray::IDLE", "ray: idle worker"),
    ("default_worker.py", "ray: idle worker"),
    ("ray::DashboardAgent", "ray: services"),
    ("ray::RuntimeEnvAgent", "ray: services"),
    ("/ray/", "ray: services"),  # gcs_server, raylet, the monitors, the minimal dashboard
    ("prefect.server", "prefect: server"),
    ("prefect worker", "prefect: worker and its runs"),
    ("prefect.engine", "prefect: worker and its runs"),
    ("prefect.runner", "prefect: worker and its runs"),
    ("mlflow", "mlflow: server"),
    ("bwrap", "reward sandboxes"),
    ("/dvc ", "dvc"),
    ("flows.", "reinforge: stages and runs"),
    ("/reinforge ", "reinforge: stages and runs"),
    ("pytest", "pytest"),
    ("execnet", "pytest"),
    ("exec(eval(sys.stdin", "pytest"),  # a pytest-xdist worker, started through execnet
)


def kind_of(cmdline: str) -> str:
    if cmdline.startswith("ray::"):
        name = cmdline.split()[0].split(".")[0]
        if name not in ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent"):
            return f"ray: {name[5:]}"
    return next((kind for part, kind in KINDS if part in cmdline + " "), "other")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the whole suite)")
    a = p.parse_args(argv)
    before, started = psutil.cpu_times(), time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *a.pytest_args])
    with TreeTimeline(proc.pid, 1.0, role=kind_of, root="pytest") as timeline:
        rc = proc.wait()
    wall, after = time.time() - started, psutil.cpu_times()
    used = cpu_by_role(timeline.samples, time.time())
    counts: dict[str, int] = {}
    last: dict[int, str] = {}
    for _, seen in timeline.samples:
        last.update({pid: kind for pid, (kind, _) in seen.items()})
    for kind in last.values():
        counts[kind] = counts.get(kind, 0) + 1
    idle = (after.idle - before.idle) + (after.iowait - before.iowait)
    busy = sum(getattr(after, f) - getattr(before, f) for f in ("user", "system", "nice", "irq", "softirq"))
    total = sum(used.values())
    print(
        f"\npytest exit {rc}; {wall:.0f} s wall; machine CPU busy {busy:.0f} s, idle {idle:.0f} s "
        f"({busy / max(busy + idle, 1e-9):.0%} busy)"
    )
    print(f"{'kind':34} {'CPU s':>8} {'share':>6} {'processes':>9}")
    for kind, cpu in sorted(used.items(), key=lambda kv: -kv[1]):
        print(f"{kind:34} {cpu:8.0f} {cpu / total:6.0%} {counts.get(kind, 0):9d}")
    print(f"{'sum (the suite tree)':34} {total:8.0f}")
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
