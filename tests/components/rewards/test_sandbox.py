"""The code sandbox against hostile programs, each run for real under bubblewrap (reliability plan: sandbox).

Each attack must end within its limit with reward 0 and a status naming the limit, leak no canary, reach no
listener, and leave no process or file behind on the host.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time

import psutil
import pytest

from components.rewards import code_exec
from components.rewards.sandbox import SLOT_UID_BASE, Sandbox, SandboxLimits, SandboxUnavailable

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (`apt-get install -y bubblewrap`; .ci/run does)")

LIMITS = SandboxLimits(timeout_s=6.0, cpu_s=2, memory_mb=256, max_processes=8, max_output_bytes=64 << 10)
CANARY = "canary-7f3a9c1e"


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(LIMITS, concurrency=2)


def sandbox_processes() -> list[psutil.Process]:
    """Processes left by a sandbox: bwrap itself, or anything running as a sandbox slot's uid."""
    left = []
    for p in psutil.process_iter(["name", "uids"]):
        try:
            if p.info["name"] == "bwrap" or SLOT_UID_BASE <= p.info["uids"].real < SLOT_UID_BASE + 64:
                left.append(p)
        except (psutil.Error, TypeError, AttributeError):
            continue
    return left


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = len(psutil.pids())
    yield
    deadline = time.monotonic() + 5  # an exited sandbox's zombie is reaped by init, not by us: give it a moment
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_processes() == []
    assert len(psutil.pids()) <= before + 5  # no forked descendants survive (slack: unrelated processes)


def score(code: str, tests=("assert True",)) -> tuple[dict[str, float], float]:
    """The code reward of `code` and the seconds it took."""
    start = time.monotonic()
    out = code_exec.score(f"```python\n{code}\n```", list(tests), None, limits=LIMITS, concurrency=2)
    return out, time.monotonic() - start


def test_a_correct_solution_scores_the_fraction_of_tests_passed():
    out, _ = score("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3", "assert add(2, 2) == 5"])
    assert out["score"] == 0.5 and out["passed"] == 1 and out["status/ok"] == 1.0


def test_fork_bomb_is_contained():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    out, seconds = score(code)
    assert out["score"] == 0.0 and out["status/timeout"] == 1.0 and seconds < LIMITS.timeout_s + 3


def test_memory_bomb_is_contained():
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))"
    out, seconds = score(code)
    assert out["score"] == 0.0 and out["status/memory"] == 1.0 and seconds < LIMITS.timeout_s


def test_infinite_loop_ignoring_sigalrm_and_sigxcpu_is_killed():
    code = ("import signal\nfor s in (signal.SIGALRM, signal.SIGXCPU, signal.SIGTERM):\n"
            "    signal.signal(s, signal.SIG_IGN)\nsignal.alarm(1)\nwhile True:\n    pass")
    out, seconds = score(code)
    assert out["score"] == 0.0 and out["status/timeout"] == 1.0 and seconds < LIMITS.timeout_s + 3


def test_parent_environment_and_files_outside_are_invisible(sandbox, tmp_path, monkeypatch):
    monkeypatch.setenv("REINFORGE_SECRET", CANARY)
    secret = tmp_path / "secret.txt"
    secret.write_text(CANARY)
    code = (f"import os, glob\nprint(dict(os.environ))\n"
            f"for p in ['/proc/1/environ', '/proc/self/environ', {str(secret)!r}, '/root/.bash_history']:\n"
            f"    try:\n        print(open(p, 'rb').read())\n    except OSError as e:\n        print('denied', p, e)\n"
            f"print(glob.glob('{tmp_path}/*'), os.listdir('/'))")
    result = sandbox.run(code)
    assert result.status == "ok", result.stderr
    assert "denied" in result.stdout and CANARY not in result.stdout + result.stderr


def test_writes_outside_the_private_tmp_fail(sandbox, tmp_path):
    targets = [tmp_path / "escaped.txt", "/usr/escaped.txt", os.path.join(os.getcwd(), "escaped.txt")]
    code = ("ok = []\n"
            f"for p in {[str(t) for t in targets]!r}:\n"
            "    try:\n        open(p, 'w').write('x')\n        ok.append(p)\n    except OSError:\n        pass\n"
            "open('/tmp/inside.txt', 'w').write('fine')\nprint('wrote', ok)")
    result = sandbox.run(code)
    assert result.status == "ok", result.stderr
    assert all(not os.path.exists(t) for t in targets)
    assert not os.path.exists("/tmp/inside.txt")  # the sandbox's /tmp is its own, gone afterwards


def test_no_network_even_to_a_loopback_listener(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(listener.accept())
        except OSError:
            pass

    code = (f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
            f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('connected')\nexcept OSError as e:\n"
            f"    print('refused', e)")
    result = sandbox.run(code)
    thread = threading.Thread(target=accept)
    thread.start()
    thread.join()
    listener.close()
    assert "connected" not in result.stdout and accepted == []


def test_a_billion_characters_of_output_stop_at_the_cap(sandbox):
    code = "import sys\nfor _ in range(10 ** 6):\n    sys.stdout.write('x' * 1000)"
    result = sandbox.run(code)
    assert result.status == "output_limit" and len(result.stdout) <= LIMITS.max_output_bytes
    assert result.wall_s < LIMITS.timeout_s
    out, _ = score(code)
    assert out["score"] == 0.0 and out["status/output_limit"] == 1.0


def test_concurrent_runs_are_limited_to_the_slots():
    box = Sandbox(SandboxLimits(timeout_s=5), concurrency=2)
    code = "import time, os\nprint(os.getuid())\ntime.sleep(0.5)"
    results = []
    threads = [threading.Thread(target=lambda: results.append(box.run(code))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status == "ok" for r in results)
    if os.getuid() == 0:  # two slots: two uids, each used twice
        uids = sorted(int(r.stdout) for r in results)
        assert uids == [SLOT_UID_BASE] * 2 + [SLOT_UID_BASE + 1] * 2


def test_missing_bubblewrap_refuses_instead_of_running_unconfined(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        Sandbox()
    from components.config import load_config
    from components.rewards.registry import scorer_for

    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        scorer_for("code", load_config(None))
