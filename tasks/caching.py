"""Persisted results for the stages whose work lives in files, so a retried flow run does not redo them.

A stage's cache key is its source and the library's (every .py under components/), the config keys it reads
(components/config/stages.py) and the content (md5) of every file it reads; a stage whose output files are missing
runs again. A retried or crashed-and-rerun flow run
therefore gets finished stages back from the result store (state `Cached`) without running their bodies,
and a changed input, config key or stage source runs the stage again. Results are stored as JSON, never
pickled.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy

from components.config.checks import config_value
from components.lineage import file_md5

# the task's bound arguments -> paths (files or directories)
PathsOf = Callable[[dict[str, Any]], list[str]]


def _none(_: dict[str, Any]) -> list[str]:
    return []


def content_digest(paths: list[str]) -> list[tuple[str, str]]:
    """(path, md5) of each file, and of every file under each directory; '-' for a missing path."""
    out = []
    for raw in paths:
        p = Path(raw)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        out += [(str(f), file_md5(f) if f.is_file() else "-") for f in files]
    return out


@lru_cache(maxsize=1)
def library_digest() -> str:
    """md5s of the library's source, so a change to the code a stage runs runs it again."""
    root = Path(__file__).resolve().parents[1] / "components"
    return json.dumps([(str(f.relative_to(root)), file_md5(f)) for f in sorted(root.rglob("*.py"))])


@dataclass
class StageCache(CachePolicy):
    """Key = task and library source + `config_keys` of the task's `cfg` + md5 of what `reads` names + the
    paths `writes` names; no cache hit while one of those is missing."""

    config_keys: tuple[str, ...] = ()
    reads: PathsOf = _none
    writes: PathsOf = _none

    def compute_key(
        self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs
    ) -> str | None:
        cfg = inputs["cfg"]
        config = {k: config_value(cfg, k) for k in self.config_keys}
        config = {k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in config.items()}
        h = hashlib.sha256(inspect.getsource(task_ctx.task.fn).encode())
        h.update(library_digest().encode())
        h.update(json.dumps(config, sort_keys=True, default=str).encode())
        h.update(json.dumps(content_digest(self.reads(inputs))).encode())
        # where it writes too: a run writing elsewhere (another data.raw_dir, a scratch copy of the config) is
        # not served the result, paths included, of one that wrote there; finding outputs at its own paths
        # says nothing about them
        writes = self.writes(inputs)
        h.update(json.dumps([str(Path(p).resolve()) for p in writes]).encode())
        key = h.hexdigest()
        missing = any(not Path(p).exists() for p in writes)
        if missing and task_ctx.result_store is not None and task_ctx.result_store.exists(key):
            # outputs deleted (by hand, or by `dvc repro` before it reruns the stage): run it again; the stored
            # result stays right for the outputs it will write, the inputs being the same
            return None
        return key


def cached_stage(policy: StageCache) -> dict:
    """Task options of a stage with a persisted JSON result under `policy`."""
    return {"cache_policy": policy, "persist_result": True, "result_serializer": "json"}


def run_stage(task, *args, **kwargs):
    """Call a cached stage and return its result, saying in the run's log (at INFO: nothing is wrong) when it
    came from the cache (its inputs unchanged since it last ran, its outputs still there) instead of
    running."""
    from tasks.common import logger

    state = task(*args, return_state=True, **kwargs)
    result = state.result()  # a failed stage raises its own error here
    if state.name == "Cached":
        from components.progress import console

        where = os.environ.get("PREFECT_RESULTS_LOCAL_STORAGE_PATH", "Prefect's result storage")
        note = (
            f"{task.name}: not run, its result is taken from the cache in {where} (the config keys and "
            "files it reads are unchanged and its outputs are there)"
        )
        logger().info(note)  # the run's Logs tab
        console.print(note, style="dim", highlight=False, soft_wrap=True)  # the terminal, as a note
    return result
