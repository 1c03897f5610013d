"""The sandbox holds memory that is no process's resident memory (issue 37, class 2), and shows nothing of the
host: new user namespaces and mounts are denied (so no tmpfs of the code's own), SysV and POSIX shared memory
and memfd are denied, the one writable place is the /tmp tmpfs of tmp_mb, and where the machine allows it the
run sits in a memory cgroup of its own. The host's shared memory (tmpfs, shm, memfd pages: /proc/meminfo's
Shmem) never grows past tmp_mb while a program that tries every way at once holds what it got."""

from __future__ import annotations

import shutil
import time

import pytest

from components.rewards.cgroup import own_memory_cgroup
from components.rewards.sandbox import Sandbox
from components.rewards.seccomp import ARCHES, seccomp_filter
from components.settings import SandboxLimits

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

LIMITS = SandboxLimits(timeout_s=20.0, cpu_s=10, memory_mb=256, tmp_mb=32, max_output_bytes=64 << 10)

# each way to hold memory outside a process's resident size, tried in turn; what succeeds is kept until the end
HOLD = r"""
import ctypes, os, mmap, time
libc = ctypes.CDLL(None, use_errno=True)
MB = 1 << 20
results, kept = {}, []

def attempt(name, fn):
    try:
        fn()
        results[name] = "ok"
    except OSError as e:
        results[name] = os.strerror(e.errno or 0)

def call(name, *args):
    def run():
        rc = getattr(libc, name)(*args)
        if rc == -1:
            raise OSError(ctypes.get_errno(), name)
        kept.append(rc)
    return run

CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x20000, 0x40000000, 0x20000000
attempt("unshare_user_mount", call("unshare", CLONE_NEWUSER | CLONE_NEWNS))
attempt("unshare_net", call("unshare", CLONE_NEWNET))
libc.syscall.restype = ctypes.c_long
SYS_CLONE = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
def clone_user():
    pid = libc.syscall(SYS_CLONE, CLONE_NEWUSER | 17, 0, 0, 0, 0)  # 17: SIGCHLD
    if pid == 0:
        os._exit(0)
    if pid < 0:
        raise OSError(ctypes.get_errno(), "clone")
    os.waitpid(pid, 0)
attempt("clone_newuser", clone_user)
attempt("mount_tmpfs", call("mount", b"none", b"/tmp", b"tmpfs", 0, b"size=1g"))
IPC_CREAT = 0o1000
attempt("sysv_shm", call("shmget", 0, 512 * MB, IPC_CREAT | 0o600))
attempt("memfd", lambda: kept.append(os.memfd_create("x")))
attempt("mq_open", call("mq_open", b"/q", os.O_CREAT | os.O_RDWR, 0o600, None))
def fill_tmp():  # as many 1 MB files as /tmp takes (RLIMIT_FSIZE caps each file)
    block = b"x" * MB
    for i in range(4096):
        with open(f"/tmp/f{i}", "wb") as f:
            f.write(block)
attempt("tmp_beyond_size", fill_tmp)
def shm_in_dev():
    with open("/dev/shm/x", "wb") as f:
        f.write(b"x" * MB)
attempt("dev_shm", shm_in_dev)
print(results, flush=True)
open("/tmp/ready", "w").close()
time.sleep(8)
"""


def shmem_kib() -> int:
    with open("/proc/meminfo") as meminfo:
        return next((int(line.split()[1]) for line in meminfo if line.startswith("Shmem:")), 0)


def test_every_way_to_hold_memory_outside_rss_is_denied_or_bounded():
    import ast
    import threading

    sandbox = Sandbox(LIMITS, concurrency=1)
    before, peak = shmem_kib(), [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], shmem_kib())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = sandbox.run(HOLD)
    finally:
        stop.set()
        sampler.join()
    tried = ast.literal_eval(result.stdout.strip().splitlines()[0])
    denied = (
        "unshare_user_mount",
        "unshare_net",
        "clone_newuser",
        "mount_tmpfs",
        "sysv_shm",
        "memfd",
        "mq_open",
    )
    assert all(tried[name] == "Operation not permitted" for name in denied), tried
    assert tried["tmp_beyond_size"] in ("No space left on device", "File too large"), tried
    assert tried["dev_shm"] != "ok", tried
    # what the program held: at most its /tmp (tmp_mb), against a baseline the other test process moves a little
    grown_mb = (peak[0] - before) / 1024
    assert grown_mb < LIMITS.tmp_mb + 16, f"host shared memory grew {grown_mb:.0f} MB"


def test_the_sandbox_shows_none_of_its_setup_or_the_host_environment(monkeypatch):
    monkeypatch.setenv("REINFORGE_SECRET", "s3cr3t")
    code = (
        "import os\n"
        "print(open('/proc/1/cmdline').read().replace('\\0', ' '))\n"
        "try:\n    print(open('/proc/1/environ').read())\nexcept OSError as e:\n    print('environ', e.errno)\n"
        "print(open('/proc/self/cgroup').read())\n"
    )
    out = Sandbox(LIMITS, concurrency=1).run(code).stdout
    assert "--ro-bind" not in out and "--tmpfs" not in out and "--seccomp" not in out, out
    assert "s3cr3t" not in out


@pytest.mark.skipif(own_memory_cgroup() is None, reason="no memory cgroup this process may write")
def test_a_run_sits_in_a_memory_cgroup_that_counts_its_tmpfs_and_is_removed_after():
    """Files in the sandbox's /tmp are no process's resident memory; the run's own cgroup counts them."""
    import threading

    own, v2 = own_memory_cgroup()

    def groups() -> list:
        return [p for p in own.iterdir() if p.name.startswith("reinforge-sandbox-")]

    before = set(groups())
    code = "open('/tmp/x', 'wb').write(b'x' * (24 << 20))\nopen('/tmp/ready', 'w').close()\nimport time; time.sleep(3)"
    limits = SandboxLimits(timeout_s=20.0, cpu_s=10, memory_mb=256, tmp_mb=32, max_output_bytes=32 << 20)
    runner = threading.Thread(target=lambda: Sandbox(limits, concurrency=1).run(code))
    runner.start()
    seen, deadline = 0, time.monotonic() + 15
    usage = "memory.current" if v2 else "memory.usage_in_bytes"
    while runner.is_alive() and time.monotonic() < deadline:
        for group in set(groups()) - before:
            try:
                if (group / "cgroup.procs").read_text().split():
                    seen = max(seen, int((group / usage).read_text()))
            except OSError:
                continue
        time.sleep(0.1)
    runner.join()
    assert seen >= 24 << 20, f"the run's cgroup held {seen >> 20} MB"  # its 24 MB file counted
    time.sleep(0.5)
    assert set(groups()) == before  # removed once the run ended


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_the_filter_is_a_whole_program_for_each_architecture(machine):
    """Hand-checked layout: 8 bytes an instruction; it starts by loading the arch, ends with the four returns
    (allow, EPERM, ENOSYS, kill), and every jump lands inside it."""
    import struct

    prog = seccomp_filter(machine)
    insns = [struct.unpack("<HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    assert insns[0] == (0x20, 0, 0, 4) and insns[2] == (0x20, 0, 0, 0)
    assert [i[3] for i in insns[-4:]] == [0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000]
    for pc, (code, jt, jf, _) in enumerate(insns):
        if code & 0x07 == 0x05:  # a jump
            assert pc + 1 + max(jt, jf) < len(insns)
    denied = len(ARCHES[machine][3])
    assert len(insns) == (4 if machine == "x86_64" else 3) + denied + 4 + 4
