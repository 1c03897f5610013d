"""The local Ray instance of a `reinforge train` process: its first actors start in warm workers, whose
imports were frozen out of the collector's scans, and stop_ray leaves none of its processes behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

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


RAY_TIMEOUT = (
    "The current node timed out during startup. This could happen because some of the raylet failed to "
    "startup or the GCS has become overloaded."
)


def test_a_local_ray_start_that_times_out_is_tried_once_more(monkeypatch):
    """Ray's raylet waits a fixed 30 s to register (a loaded machine passes it): the start is tried again, and
    Ray's GCS wait is given the setting."""
    from components.training import cluster

    calls = []

    def slow_then_up(warm_workers):
        calls.append(warm_workers)
        if len(calls) == 1:
            raise Exception(RAY_TIMEOUT)  # what Ray raises

    monkeypatch.setattr(cluster, "local_init", slow_then_up)
    # the failed start's processes are stopped; not this test process's own Ray, which other tests use
    monkeypatch.setattr(cluster.ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.delenv(cluster.GCS_WAIT_ENV, raising=False)
    cluster.start_local(True, 300)
    assert calls == [True, "shutdown", True] and cluster.os.environ[cluster.GCS_WAIT_ENV] == "300"


def test_a_local_ray_start_that_never_comes_up_is_one_line_naming_the_setting(monkeypatch):
    from components.errors import ServiceError
    from components.training import cluster

    def never(warm_workers):
        raise Exception(RAY_TIMEOUT + "\nmore of Ray's lines")

    monkeypatch.setattr(cluster, "local_init", never)
    monkeypatch.setattr(cluster.ray, "shutdown", lambda: None)
    with pytest.raises(ServiceError) as err:
        cluster.start_local(False, 90)
    message = str(err.value)
    assert "\n" not in message and "did not start in 2 tries" in message
    assert "The current node timed out during startup" in message
    assert "trainer.ray_start_timeout_s (now 90)" in message and "trainer.backend=local" in message
