"""The Ray instance a run's workers live in: RAY_ADDRESS's cluster, or a local one. A module of its own that
imports Ray alone (not torch), so `reinforge` can start Ray while the flow's modules are still importing."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray

from components.shutdown import reclaim_signals

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def ensure_ray() -> None:
    """ray.init() once: RAY_ADDRESS's cluster (shipping our code to it) or a local instance. Every call (in the
    main thread) puts our signal handlers back: a library that started since (Prefect's flow engine, or Ray
    itself) may have replaced them."""
    if ray.is_initialized():
        reclaim_signals()
        return
    address = os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}}
    if address:
        runtime_env["py_modules"] = [str(PROJECT_ROOT / "components")]
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:
        # logical CPUs beyond the cores, so a few policy workers and the rollout worker fit on a small machine
        # (each runs trainer.num_threads threads); "local": a new instance even when `ray start` left its address;
        # no idle workers started ahead, not even the two for the first driver (each is a Python process of
        # ~80 MB that a run never uses). Token authentication stays on (Ray's default for a local instance),
        # without the notice Ray prints about it on every run
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        ray.init(
            address="local",
            num_cpus=max(8, os.cpu_count() or 2),
            include_dashboard=False,
            runtime_env=runtime_env,
            log_to_driver=True,
            configure_logging=False,
            _system_config={
                "enable_worker_prestart": False,
                "prestart_worker_first_driver": False,
                "worker_niceness": 0,
            },
        )
    reclaim_signals()
