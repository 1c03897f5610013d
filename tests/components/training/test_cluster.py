"""The local Ray instance of a `reinforge train` process: its first actors start in warm workers, whose
imports were frozen out of the collector's scans, and stop_ray leaves none of its processes behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# a fresh process (the tests' session Ray is started without warm workers): ensure_ray(warm_workers=True),
# then an actor, which must land in one of the prestarted processes with the workers' modules imported
PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    import psutil, ray
    from components.training.cluster import WARM_WORKERS, ensure_ray

    ensure_ray(warm_workers=True)
    deadline = time.time() + 120
    def idle():  # this instance's idle workers (its raylet is a child of this process)
        def named(p):  # one that exits (or is a zombie) while we look is not idle
            try:
                return "ray::IDLE" in " ".join(p.cmdline())
            except psutil.Error:
                return False
        return [p.pid for p in psutil.Process().children(recursive=True) if named(p)]
    while time.time() < deadline and len(idle()) < WARM_WORKERS:
        time.sleep(0.2)
    warm = idle()
    # an actor created now waits for a warm worker's preload (torch, transformers' modeling code, ours)

    @ray.remote(num_cpus=1)
    class Probe:
        def where(self):
            import gc

            return os.getpid(), "components.training.ray_workers" in sys.modules, gc.get_freeze_count()

    started = time.time()
    pid, preloaded, frozen = ray.get(Probe.remote().where.remote())
    start_s = time.time() - started

    from components.training.cluster import stop_ray

    node = [i.process for v in ray._private.worker._global_node.all_processes.values() for i in v]
    stop_ray()
    left = [p.pid for p in node if p.poll() is None]
    print(json.dumps({"warm": warm, "pid": pid, "preloaded": preloaded, "frozen": frozen, "start_s": start_s,
                      "left": left, "initialized": ray.is_initialized()}))
    """
)


def test_a_reinforge_process_actors_start_in_warm_workers():
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out["warm"]) == 2  # WARM_WORKERS, not one per core
    assert out["pid"] in out["warm"] and out["preloaded"], out
    assert out["frozen"] > 100_000, out  # torch's and transformers' objects, out of every later scan
    assert out["left"] == [] and not out["initialized"], out  # the monitor too, killed rather than waited for
