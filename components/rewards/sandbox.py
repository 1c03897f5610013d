"""Run model-written Python in a bubblewrap sandbox: no network, a private empty /tmp as the only writable
place, a read-only view of the interpreter, an environment allow-list, rlimits and a wall-clock timeout.

Where `bwrap` is missing the sandbox refuses to run (SandboxUnavailable) rather than run code unconfined.

Layout of one run: `bwrap` (started in its own session, so a timeout kills its whole process group) creates
new net, pid, ipc and uts namespaces and mounts, read-only, the interpreter's prefix plus /usr and /lib; the
program reads the code from stdin. Running as root, the sandboxed Python drops to an unprivileged uid of its
own slot (60000 + slot) before the code runs, so RLIMIT_NPROC counts only that sandbox's processes; as any
other user, bwrap adds a user namespace and the process limit counts on top of the user's current processes.
Stdout and stderr go to files capped by RLIMIT_FSIZE, so printing 10^9 characters stops at the cap.
"""

from __future__ import annotations

import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `apt-get install -y bubblewrap`; Fedora: `dnf install "
                "bubblewrap`), or do not use the code reward")
ENV_ALLOW = ("LANG", "LC_ALL")  # the only variables copied from the parent; everything else is cleared
SLOT_UID_BASE = 60000


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create its namespaces here: code is never run unconfined."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, then the whole process group is killed
    cpu_s: int = 5  # RLIMIT_CPU (SIGXCPU, then SIGKILL one second later)
    memory_mb: int = 512  # RLIMIT_AS
    max_processes: int = 16  # RLIMIT_NPROC
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # RLIMIT_FSIZE: stdout, stderr and any file written in /tmp
    tmp_mb: int = 64  # size of the private tmpfs


@dataclass
class SandboxResult:
    """status: ok | error (non-zero exit) | timeout (wall or CPU) | memory | output_limit."""

    status: str
    returncode: int
    stdout: str
    stderr: str
    wall_s: float


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(f"the code sandbox needs bubblewrap (`bwrap` is not on PATH): {INSTALL_HINT}")
    return path


def _ro_binds() -> list[str]:
    """Read-only mounts: the system libraries and the prefix of the interpreter that runs the code."""
    paths = list(dict.fromkeys(["/usr", "/lib", "/lib64", "/bin", sys.base_prefix,
                                os.path.dirname(_interpreter())]))
    parents: list[str] = []  # e.g. /root for a pyenv interpreter: made traversable (and empty) in the sandbox
    for path in paths:
        parent = os.path.dirname(path)
        while parent not in ("/", "") and parent not in parents:
            parents.insert(0, parent)
            parent = os.path.dirname(parent)
    args = [a for d in sorted(parents, key=len) for a in ("--perms", "0755", "--dir", d)]
    for path in paths:  # a symlink such as /lib64 -> usr/lib64 is mounted at its own path (the loader's)
        if os.path.exists(path):
            args += ["--ro-bind", os.path.realpath(path), path]
    return args


def _interpreter() -> str:
    """The base interpreter (a venv's python is a symlink to it): only the standard library is visible."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _user_processes() -> int:
    uid, count = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                count += os.stat(f"/proc/{pid}").st_uid == uid
            except OSError:
                pass
    return count


class Sandbox:
    """Runs code under `limits`, at most `concurrency` programs at once (each in its own uid slot)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), concurrency: int = 2):
        self.limits = limits
        self.bwrap = bwrap_path()
        self.as_root = os.getuid() == 0
        self._slots: queue.Queue[int] = queue.Queue()
        for slot in range(concurrency):
            self._slots.put(slot)

    def _command(self) -> list[str]:
        lim = self.limits
        ns = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not self.as_root:
            ns = ["--unshare-all"]  # includes the user namespace an unprivileged bwrap needs
        env = ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
               "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "PYTHONHASHSEED", "0"]
        for key in ENV_ALLOW:
            if key in os.environ:
                env += ["--setenv", key, os.environ[key]]
        caps = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if self.as_root else []
        return [self.bwrap, *ns, "--die-with-parent", "--new-session", *env, *_ro_binds(),
                "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(lim.tmp_mb << 20), "--tmpfs", "/tmp",
                "--chdir", "/tmp", *caps, "--", _interpreter(), "-I", "-"]

    def _preexec(self, nproc: int):
        lim = self.limits

        def apply() -> None:
            mem = lim.memory_mb << 20
            for kind, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, nproc),
                                (resource.RLIMIT_NOFILE, lim.max_open_files),
                                (resource.RLIMIT_FSIZE, lim.max_output_bytes), (resource.RLIMIT_CORE, 0)):
                resource.setrlimit(kind, (value, value))
            resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))

        return apply

    def run(self, code: str) -> SandboxResult:
        """Run `code` (a Python program) and classify how it ended; never raises for what the code does."""
        slot = self._slots.get()
        try:
            return self._run(code, slot)
        finally:
            self._slots.put(slot)

    def _run(self, code: str, slot: int) -> SandboxResult:
        lim = self.limits
        if self.as_root:
            uid = SLOT_UID_BASE + slot
            code = (f"import os as _o\n_o.setgroups([]); _o.setgid({uid}); _o.setuid({uid})\ndel _o\n") + code
            nproc = lim.max_processes
        else:
            nproc = _user_processes() + lim.max_processes
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="reinforge-sandbox-") as tmp:
            out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(self._command(), stdin=subprocess.PIPE, stdout=out, stderr=err,
                                        preexec_fn=self._preexec(nproc), start_new_session=True, close_fds=True)
                timed_out = False
                try:
                    proc.communicate(code.encode(), timeout=lim.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    _kill_group(proc.pid)
                    proc.wait()
            stdout, out_size = _read_capped(out_path, lim.max_output_bytes)
            stderr, _ = _read_capped(err_path, lim.max_output_bytes)
        rc = proc.returncode
        if timed_out or rc in (128 + signal.SIGXCPU, -signal.SIGXCPU, 128 + signal.SIGKILL, -signal.SIGKILL):
            status = "timeout"
        elif out_size >= lim.max_output_bytes or "File too large" in stderr[-500:]:
            status = "output_limit"
        elif "MemoryError" in stderr[-2000:] or "Cannot allocate memory" in stderr[-2000:]:
            status = "memory"
        elif rc == 0:
            status = "ok"
        elif rc == 1 and stderr.startswith("bwrap:"):
            raise SandboxUnavailable(f"bubblewrap could not start the sandbox: {stderr.strip()[:300]}; "
                                     "it needs user namespaces (or root). Code is not run unconfined.")
        else:
            status = "error"
        return SandboxResult(status, rc, stdout, stderr, time.perf_counter() - start)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(path: str, limit: int) -> tuple[str, int]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        data = f.read(limit)
    return data.decode("utf-8", "replace"), size
