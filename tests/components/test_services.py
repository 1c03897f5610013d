"""The Prefect server `reinforge` starts for its run (components/services.py) never outlives the run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

START = (
    "from components.services import own_prefect_server, start_prefect_server_early\n"
    "start_prefect_server_early()\n"
    "print(own_prefect_server(), flush=True)\n"
    "import time; time.sleep(120)\n"
)


def test_the_runs_prefect_server_stops_when_the_run_is_sigkilled():
    """SIGKILL skips atexit: the server is told by the kernel (PR_SET_PDEATHSIG) that its parent died."""
    run = subprocess.Popen([sys.executable, "-c", START], stdout=subprocess.PIPE, text=True)
    server = psutil.Process(int(run.stdout.readline()))
    assert "uvicorn" in " ".join(server.cmdline())
    run.send_signal(signal.SIGKILL)
    run.wait(10)
    deadline = time.time() + 30
    while time.time() < deadline and server.is_running() and server.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.1)
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
