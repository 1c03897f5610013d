"""bench/startup.py's CPU accounting: which process a command line is, and the CPU each had used by an instant."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.startup import TreeTimeline, cpu_by_role, role_of


def test_each_process_of_a_start_up_gets_its_role():
    venv = "/x/.venv/lib/python3.11/site-packages"
    assert role_of(f"{venv}/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray") == "ray services"
    assert role_of(f"python -u {venv}/ray/_private/log_monitor.py --session-dir=x") == "ray services"
    assert role_of("ray::DashboardAgent") == "ray services"
    assert role_of("ray::PolicyWorker.update") == "ray workers"
    assert (
        role_of(f"python {venv}/ray/_private/workers/default_worker.py --node-ip-address=1") == "ray workers"
    )
    assert role_of("python -m uvicorn --factory prefect.server.api.server:create_app") == "prefect server"
    assert role_of("/usr/bin/bwrap --unshare-all") == "other"


def test_cpu_by_role_takes_each_process_s_last_sample_before_the_instant():
    samples = [
        (1.0, {1: ("driver", 0.5), 2: ("ray workers", 0.1)}),
        (2.0, {1: ("driver", 1.5), 3: ("prefect server", 0.7), 4: ("ray workers", 0.2)}),
        (3.0, {1: ("driver", 2.5), 3: ("prefect server", 0.9)}),
    ]
    # process 2 ended after its first sample: its CPU then still counts; nothing of the sample at 3.0 does
    assert cpu_by_role(samples, until=2.5) == {"driver": 1.5, "ray workers": 0.1 + 0.2, "prefect server": 0.7}
    assert cpu_by_role(samples, until=0.5) == {}


def test_the_timeline_splits_the_cpu_and_the_peak_memory_of_a_process_and_its_child_by_role():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    hold = "b = bytearray(200 * 2**20)\nb[::4096] = b'x' * len(b[::4096])\n"
    # the driver burns 0.6 CPU-s, then starts a child (named as Ray names an actor) that holds 200 MiB and
    # burns 0.6 CPU-s more, and waits for it
    child = hold + burn + "#ray::Child"
    code = f"import subprocess, sys\n{burn}subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    with TreeTimeline(proc.pid, interval_s=0.05) as tree:
        proc.wait(timeout=60)
    used = cpu_by_role(tree.samples, until=time.time())
    assert 0.3 <= used["driver"] <= 1.5, used  # less than the burn: CPU after the last sample is lost
    assert 0.3 <= used["ray workers"] <= 1.5, used  # `ray::` in its command line, as Ray names its actors
    assert tree.rss_at_peak["ray workers"] >= 180 * 2**20, tree.rss_at_peak  # the child's, not the driver's
    assert tree.rss_at_peak["driver"] < 100 * 2**20, tree.rss_at_peak
    assert tree.peak_rss == sum(tree.rss_at_peak.values())
