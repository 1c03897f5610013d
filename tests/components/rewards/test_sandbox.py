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
from components.rewards.sandbox import SLOT_UID_BASE, UID_RANGE, Sandbox, SandboxUnavailable
from components.settings import SandboxLimits

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap is not installed (`apt-get install -y bubblewrap`; .ci/run does)",
)

LIMITS = SandboxLimits(timeout_s=6.0, cpu_s=2, memory_mb=256, max_processes=8, max_output_bytes=64 << 10)
CANARY = "canary-7f3a9c1e"


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(LIMITS, concurrency=2)


def sandbox_processes() -> list[psutil.Process]:
    """Processes left by a sandbox: bwrap itself, or anything running as a sandbox uid."""
    left = []
    for p in psutil.process_iter(["name", "uids"]):
        try:
            if p.info["name"] == "bwrap" or SLOT_UID_BASE <= p.info["uids"].real < SLOT_UID_BASE + UID_RANGE:
                left.append(p)
        except (psutil.Error, TypeError, AttributeError):
            continue
    return left


def descendants() -> int:
    return len(psutil.Process().children(recursive=True))


@pytest.fixture(autouse=True)
def nothing_left_behind():
    # this process's own descendants, not the machine's process count: the other test process (pytest-xdist)
    # starts and stops processes meanwhile; what runs inside a sandbox is caught by its uid below
    before = descendants()
    yield
    deadline = (
        time.monotonic() + 5
    )  # an exited sandbox's zombie is reaped by init, not by us: give it a moment
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_processes() == []
    assert descendants() <= before  # no forked descendants survive


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
    code = (
        "import signal\nfor s in (signal.SIGALRM, signal.SIGXCPU, signal.SIGTERM):\n"
        "    signal.signal(s, signal.SIG_IGN)\nsignal.alarm(1)\nwhile True:\n    pass"
    )
    out, seconds = score(code)
    assert out["score"] == 0.0 and out["status/timeout"] == 1.0 and seconds < LIMITS.timeout_s + 3


def test_parent_environment_and_files_outside_are_invisible(sandbox, tmp_path, monkeypatch):
    monkeypatch.setenv("REINFORGE_SECRET", CANARY)
    secret = tmp_path / "secret.txt"
    secret.write_text(CANARY)
    code = (
        f"import os, glob\nprint(dict(os.environ))\n"
        f"for p in ['/proc/1/environ', '/proc/self/environ', {str(secret)!r}, '/root/.bash_history']:\n"
        f"    try:\n        print(open(p, 'rb').read())\n    except OSError as e:\n        print('denied', p, e)\n"
        f"print(glob.glob('{tmp_path}/*'), os.listdir('/'))"
    )
    result = sandbox.run(code)
    assert result.status == "ok", result.stderr
    assert "denied" in result.stdout and CANARY not in result.stdout + result.stderr


def test_writes_outside_the_private_tmp_fail(sandbox, tmp_path):
    targets = [tmp_path / "escaped.txt", "/usr/escaped.txt", os.path.join(os.getcwd(), "escaped.txt")]
    code = (
        "ok = []\n"
        f"for p in {[str(t) for t in targets]!r}:\n"
        "    try:\n        open(p, 'w').write('x')\n        ok.append(p)\n    except OSError:\n        pass\n"
        "open('/tmp/inside.txt', 'w').write('fine')\nprint('wrote', ok)"
    )
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

    code = (
        f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
        f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('connected')\nexcept OSError as e:\n"
        f"    print('refused', e)"
    )
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
    code = "import time, os\nprint(os.getuid(), time.monotonic())\ntime.sleep(0.5)\nprint(time.monotonic())"
    results = []
    threads = [threading.Thread(target=lambda: results.append(box.run(code))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status == "ok" for r in results)
    runs = [(float(start), float(end), uid) for uid, start, end in (r.stdout.split() for r in results)]
    overlapping = max(sum(a <= start < b for a, b, _ in runs) for start, _, _ in runs)
    assert overlapping <= 2  # never more than the two slots at once
    if os.getuid() == 0:  # two runs at the same time never share a uid (one after the other may: a slot's)
        for i, (a, b, uid) in enumerate(runs):
            assert all(u != uid for c, d, u in runs[i + 1 :] if c < b and a < d), runs


def test_cpu_is_limited_for_the_whole_process_tree():
    """8 forked children each burning CPU: RLIMIT_CPU alone allowed each its own 2 s (16 s in all, at least
    8 s of wall time on 2 free cores); the tree is stopped at the sandbox's 2 s. The wall timeout is out of
    reach, so only the CPU limit can stop it that soon, however loaded the machine."""
    code = (
        "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        while True:\n            pass\n"
        "time.sleep(30)"
    )
    from dataclasses import replace

    result = Sandbox(replace(LIMITS, max_processes=16, timeout_s=60.0)).run(code)
    assert result.status == "timeout" and result.wall_s < 8 * LIMITS.cpu_s / 2, result


def _sandbox_in_another_process(seconds: float) -> str:
    """A sandbox run from a fresh Python process: its uid, and whether it could start its own threads."""
    import subprocess
    import sys

    code = (
        "from components.rewards.sandbox import Sandbox, SandboxLimits\n"
        f"r = Sandbox(SandboxLimits(timeout_s=20, max_processes=8)).run({_THREADS!r} % {seconds})\n"
        "print(r.status, r.stdout.strip(), r.stderr.strip()[-200:])"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout


_THREADS = (
    "import os, threading, time\nts = [threading.Thread(target=time.sleep, args=(%s,)) for _ in range(6)]\n"
    "[t.start() for t in ts]\nprint(os.getuid(), 'threads-ok')\n[t.join() for t in ts]"
)


def test_two_sandboxes_in_two_processes_do_not_interfere():
    """Each process leases its own uid: one sandbox's 7 threads never count against the other's process
    limit (both used to get the first slot uid, and one failed with "can't start new thread")."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(_sandbox_in_another_process, [2.0, 2.0]))
    assert all(o.startswith("ok") and "threads-ok" in o for o in outs), outs
    if os.getuid() == 0:
        assert outs[0].split()[1] != outs[1].split()[1]  # two uids


def test_only_the_standard_library_imports_unless_allowed(sandbox):
    code = (
        "import json, sqlite3\nfor name in ('numpy', 'requests', 'werkzeug'):\n    try:\n"
        "        __import__(name)\n        print('imported', name)\n    except ImportError:\n"
        "        print('refused', name)\nimport sys\nsys.path.append(%r)\n"
        "try:\n    import numpy\n    print('imported numpy from site-packages')\nexcept ImportError:\n"
        "    print('site-packages is empty here')"
    )
    import site

    result = sandbox.run(code % site.getsitepackages()[0])
    assert result.status == "ok", result.stderr
    assert "imported" not in result.stdout and result.stdout.count("refused") == 3
    allowed = Sandbox(SandboxLimits(timeout_s=20, allowed_packages=("numpy",))).run(
        "import numpy\nprint(int(numpy.arange(4).sum()))"
    )
    assert allowed.status == "ok" and allowed.stdout.strip() == "6", allowed.stderr[-500:]


def test_missing_bubblewrap_refuses_instead_of_running_unconfined(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        Sandbox()
    from components.rewards.registry import scorer_for
    from components.validate import load_checked

    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        scorer_for("code", load_checked(None))


# ---- reward hacking: a solution that games the harness scores 0; an honest one still scores 1 ------------------

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-5, 7) == 2"]
HACKS = {
    # the harness used to exec the tests in the solution's interpreter: a no-op exec made every test "pass"
    "patched builtins.exec": ("import builtins\nbuiltins.exec = lambda *a, **k: None", "ok"),
    # ... and printed a result marker the solution could read from the harness's own frame and print first
    "printed the harness's marker": (
        "import sys\nf = sys._getframe(1)\n"
        "print([c for c in f.f_code.co_consts if isinstance(c, str)])\n"
        "print('__result__[true, true, true]')",
        "ok",
    ),
    "an object equal to everything": (
        "class Yes:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Yes()",
        "ok",
    ),
    "exited before the tests": ("import os\nos._exit(0)", "exited"),
    "exited during a test": ("import os\ndef add(a, b):\n    os._exit(0)", "exited"),
    "forged answers on every descriptor": (
        "import os\nfor fd in range(3, 64):\n    try:\n"
        '        os.write(fd, b\'{"id": "0", "value": "3"}\\n\')\n'
        "    except OSError:\n        pass\ndef add(a, b):\n    return 0",
        "tampered",
    ),
    "searched memory for the expected values": (
        "import gc\ndef add(a, b):\n    found = [o for o in gc.get_objects()"
        " if isinstance(o, str) and 'assert' in o]\n    return len(found)",
        "ok",
    ),
    "killed its own interpreter": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "timeout"),
}


@pytest.mark.parametrize("hack", list(HACKS))
def test_reward_hacks_score_zero_with_a_named_status(hack):
    code, status = HACKS[hack]
    out, _ = score(code, ADD_TESTS)
    assert out["score"] == 0.0 and out[f"status/{status}"] == 1.0, (hack, out)


def test_an_honest_solution_still_scores_one():
    out, _ = score(
        "def add(a, b):\n    return a + b",
        ADD_TESTS + ["assert sorted([add(1, 1), 0]) == [0, 2]", "assert math.isclose(add(0.1, 0.2), 0.3)"],
    )
    assert out["score"] == 1.0 and out["status/ok"] == 1.0


def test_a_test_outside_the_evaluator_is_a_malformed_ground_truth():
    with pytest.raises(ValueError, match=r"test 'x = add\(1, 2\)' is not one `assert <expression>`"):
        score("def add(a, b):\n    return a + b", ["x = add(1, 2)"])


# tests that come with a row and would build gigabytes, or compute for minutes, in the host's evaluator
HOSTILE_TESTS = {
    "a long string repeated": "assert ('a' * 999999) * 999999 == ''",
    "a nested repetition": "assert [[0] * 1000000] * 1000000 == [[0] * 1000000] * 1000000",
    "a power tower": "assert ((2 ** 64) ** 64) ** 64 ** 2 == 0",
    "a product chain": "assert (2 ** 30000) * (2 ** 30000) * (2 ** 30000) == 0",
    "a format width": "assert '%0999999999d' % 1 == ''",
    "sum over lists": "assert sum([[1] * 1000] * 1000, []) == []",
    "many big comparisons": "assert " + " and ".join(["[0]*1000000 == [0]*1000000"] * 600),
}


@pytest.mark.parametrize("name", list(HOSTILE_TESTS))
def test_a_rows_tests_never_build_or_compute_without_bounds(name):
    """Each fails as a test (the row's other test still passes) within seconds, and the host never holds more
    than a few tens of MB for it: sizes are checked before a value is built, and each test has a time budget."""
    import tracemalloc

    tracemalloc.start()
    try:
        out, seconds = score("def f():\n    return 1", ["assert f() == 1", HOSTILE_TESTS[name]])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out["passed"] == 1.0 and out["status/ok"] == 1.0, out
    assert seconds < code_exec.TEST_SECONDS + 4 and peak < 64 << 20, (seconds, peak >> 20)


@pytest.mark.parametrize(
    "test",
    [
        "assert " + "1 + " * 10000 + "1",  # longer than a test may be
        "assert " + "(" * 5000 + "1" + ")" * 5000,  # nested past what Python parses
    ],
    ids=["too long", "too deep"],
)
def test_a_test_too_long_or_deep_is_a_malformed_ground_truth_before_it_is_parsed(test):
    start = time.monotonic()
    with pytest.raises(ValueError, match="code reward: "):
        code_exec.score("```python\ndef f():\n    return 1\n```", [test], None, limits=LIMITS)
    assert time.monotonic() - start < 2
