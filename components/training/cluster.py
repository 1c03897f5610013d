"""The Ray instance a run's workers live in: RAY_ADDRESS's cluster, or a local one. A module of its own that
imports Ray alone (not torch), so `reinforge` can start Ray while the flow's modules are still importing."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import ray

from components.errors import ServiceError
from components.shutdown import reclaim_signals

PROJECT_ROOT = Path(__file__).resolve().parents[2]


# what every actor of a run imports (~5 s of a 2-core machine's time per process): the workers' modules, and
# transformers' modeling code, which they import lazily when they build the model
WORKER_MODULES = ["components.training.ray_workers", "transformers.modeling_utils"]
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
# how many: the policy worker and the reward scorer of a one-worker run. Ray would otherwise prestart one per
# core (64 on a large node, each importing torch, with the driver's registration waiting for them); its
# idle-worker soft limit caps the prestart
WARM_WORKERS = 2


# Ray's own wait for its GCS follows this variable; the raylet's registration wait is a fixed 30 s
GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"
START_TRIES = 2


def ensure_ray(warm_workers: bool = False, start_timeout_s: float = 120.0) -> None:
    """ray.init() once: RAY_ADDRESS's cluster (shipping our code to it) or a local instance. Every call (in the
    main thread) puts our signal handlers back: a library that started since (Prefect's flow engine, or Ray
    itself) may have replaced them. A local instance that does not start (a loaded machine) is tried once
    more, its GCS given `start_timeout_s` (trainer.ray_start_timeout_s); then ServiceError in one line.

    `warm_workers` (a process that runs one training run, started by `reinforge`): the local instance starts
    WARM_WORKERS idle worker processes at once, which import WORKER_MODULES while this process still imports the
    flow's; the run's first actors take them and start in ~0.3 s instead of ~5 s. Every later worker process
    imports them too, so a long-lived process (the tests) leaves this off."""
    if ray.is_initialized():
        reclaim_signals()
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        runtime_env = {"env_vars": WORKER_ENV, "py_modules": [str(PROJECT_ROOT / "components")]}
        # Ray's INFO lines (connecting, connected, the code package pushed) are not the user's business
        try:
            ray.init(
                address=address, runtime_env=runtime_env, log_to_driver=True, logging_level=logging.WARNING
            )
        except RuntimeError as exc:
            if "No node info found" not in str(exc):
                raise
            raise ServiceError(no_local_node(address)) from None
    else:
        # the local instance's processes inherit this environment; a runtime_env would keep the run's actors
        # off the warmed workers (Ray starts workers of another environment for them)
        os.environ.update(WORKER_ENV)
        # logical CPUs beyond the cores, so a few policy workers and the rollout worker fit on a small machine
        # (each runs trainer.num_threads threads); "local": a new instance even when `ray start` left its address;
        # no idle workers started ahead unless warm_workers (each is a Python process of ~80 MB, ~500 MB
        # once warmed, that a run may never use). Token authentication stays on (Ray's default for a local
        # instance), without the notice Ray prints about it on every run
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        start_local(warm_workers, start_timeout_s)
    reclaim_signals()


def no_local_node(address: str) -> str:
    """The line for a driver that reached the cluster's GCS but found no node of it under the address it
    connects from (a head started without --node-ip-address registers as the machine's address, not as the
    127.0.0.1 RAY_ADDRESS names): the addresses the nodes did register under, asked of the GCS."""
    try:
        from ray._raylet import GcsClient
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        infos = GcsClient(address=address).get_all_node_info(
            timeout=5, state_filter=GcsNodeInfo.GcsNodeState.ALIVE
        )
        found = sorted({info.node_manager_address for info in infos.values()})
    except Exception:  # noqa: BLE001 - the line is still worth printing without them
        found = []
    port = address.rsplit(":", 1)[-1]
    use = f"RAY_ADDRESS={found[0]}:{port}" if found else "the address `ray start` printed"
    return (
        f"RAY_ADDRESS={address}: the cluster answers there, but no Ray node on this machine registered under that "
        f"address (its nodes: {', '.join(found) or 'none found'}); set {use}, or start the nodes with "
        "--node-ip-address matching RAY_ADDRESS."
    )


def private_temp_dir() -> str | None:
    """Where a local instance keeps its session (logs, sockets, runtime resources): a directory only this user
    can enter. Ray's default, /tmp/ray, is shared, and its session directories are writable by every local
    user. None when RAY_TMPDIR names one (the user's choice)."""
    if os.environ.get("RAY_TMPDIR"):
        return None
    import stat
    import tempfile

    # short: a session's socket paths must fit the 107 bytes of a Unix socket's name
    path = Path(tempfile.gettempdir()) / f"reinforge-ray-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ServiceError(
            f"{path}, where this user's local Ray instances keep their sessions, is not a directory of this "
            "user's; remove it (another user may have made it to read this one's sessions), or set RAY_TMPDIR."
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return str(path / "r")  # Ray makes its root 0777: the private directory is the one above it


def local_init(warm_workers: bool) -> None:
    """ray.init() of a local instance (see ensure_ray)."""
    ray.init(
        address="local",
        _temp_dir=private_temp_dir(),
        num_cpus=max(8, os.cpu_count() or 2),
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
        _system_config={
            "enable_worker_prestart": False,
            "prestart_worker_first_driver": warm_workers,
            "worker_niceness": 0,
        }
        | (
            {
                "preload_python_modules": ["components.training.preload"],
                "num_workers_soft_limit": WARM_WORKERS,
            }
            if warm_workers
            else {}
        ),
    )


def start_local(warm_workers: bool, timeout_s: float) -> None:
    """A local instance, started in at most START_TRIES tries (the processes of a failed one stopped first): a
    machine at load 20-47 on 2 cores has been seen to take longer than Ray's fixed waits. ServiceError in one
    line naming what timed out and what to set when it still does not start."""
    os.environ.setdefault(GCS_WAIT_ENV, str(max(1, round(timeout_s))))
    began = time.monotonic()
    for attempt in range(1, START_TRIES + 1):
        try:
            local_init(warm_workers)
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises plain Exception and RuntimeError on a slow start
            ray.shutdown()  # the processes it had started
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            if attempt < START_TRIES and time.monotonic() - began < timeout_s:
                logging.getLogger("reinforge").warning("Ray did not start (%s); trying once more", first)
                continue
            load = os.getloadavg()[0]
            raise ServiceError(
                f"a local Ray instance did not start in {attempt} tries ({time.monotonic() - began:.0f} s; "
                f"Ray said: {first}); this machine's load is {load:.1f} on {os.cpu_count()} cores. Raise "
                f"trainer.ray_start_timeout_s (now {timeout_s:g}), run when the machine is less busy, or "
                "run without Ray: trainer.backend=local."
            ) from None


def stop_ray() -> None:
    """ray.shutdown() at the end of a command that started a local instance, without its waits: the
    autoscaler's monitor sleeps through SIGTERM, so Ray's shutdown gives it a full second before killing it
    (it holds nothing to save, so it is killed first), and Ray's own exit hook sleeps 0.5 s more."""
    node = ray._private.worker._global_node  # set only when this process started the instance
    if node is not None:
        for info in node.all_processes.get("monitor", []):
            if info.process.poll() is None:
                info.process.kill()
    if ray.is_initialized():
        ray.shutdown()
