"""Prefect's in-process server runs at low CPU priority and still records every task run."""

from __future__ import annotations

import psutil
from prefect import flow, task
from prefect.context import get_run_context

from flows._args import yield_prefect_server
from tests.flows.conftest import task_runs


@task(task_run_name="double-{x}")
def _double(x: int) -> int:
    return 2 * x


@flow
def _probe() -> tuple[int | None, str]:
    pid = yield_prefect_server()
    for i in range(5):
        _double(i)
    return pid, str(get_run_context().flow_run.id)


def test_server_is_niced_and_records_every_task_run():
    pid, run_id = _probe()
    server = psutil.Process(pid)
    assert "uvicorn" in " ".join(server.cmdline()) and server.nice() == 19
    assert server.ppid() == psutil.Process().pid  # our own ephemeral server, never a user's
    expected = {f"double-{i}" for i in range(5)}
    runs = task_runs(run_id, expected)
    assert runs.keys() == expected and all(r.state.is_completed() for r in runs.values())


def test_niceness_zero_leaves_the_server_alone():
    assert yield_prefect_server(0) is None
