"""Run model-written Python in a bubblewrap sandbox: no network, a private empty /tmp as the only writable
place, a read-only view of the interpreter's standard library, an environment allow-list, limits for the
whole process tree and a wall-clock timeout.

Where `bwrap` is missing the sandbox refuses to run (SandboxUnavailable) rather than run code unconfined.

Layout of one run: `bwrap` (started in its own session, so a timeout kills its whole process group) creates
new net, pid, ipc and uts namespaces and mounts, read-only, /usr, /lib and the interpreter's prefix, with
every site-packages (and Debian's dist-packages) hidden under an empty tmpfs: the code imports the standard
library and only the packages `allowed_packages` names (mounted read-only under /opt/reinforge-packages).
Python starts with -I -S (no user or site directories).

Limits count the whole process tree of a run, not each process: a watcher sums the CPU time and resident
memory of every process under bwrap and kills the group at `cpu_s` or `memory_mb` (rlimits stay on each
process as a second line). Memory that is no process's resident memory is held too: a seccomp filter
(components/rewards/seccomp.py) denies new namespaces, mounts, SysV and POSIX shared memory and memfd, so the
only writable place is the /tmp tmpfs of `tmp_mb`; and where the machine allows it, the run is in a memory
cgroup of its own (components/rewards/cgroup.py) limited to memory_mb + tmp_mb, which counts every page the run
causes. bwrap reads its arguments from a pipe (`--args`), so the sandbox's /proc/1/cmdline shows none of them,
and bwrap itself runs with an empty environment.

Running as root, the code drops to a uid leased for the run from a machine-wide range (a lock file per uid),
so two sandboxes, in this process or any other, never share a uid, and RLIMIT_NPROC counts only that sandbox's
processes; as any other user, bwrap adds a user namespace and the watcher also kills a tree over
`max_processes`. Stdout and stderr go to files capped by RLIMIT_FSIZE, so printing 10^9 characters stops at
the cap.

`Sandbox.session` keeps the program running and talks to it over pipes: the code reward runs the
solution there and asks it for the values of calls, one at a time (components/rewards/code_exec.py).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import queue
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from components.rewards.cgroup import MemoryCgroup, memory_cgroup
from components.rewards.seccomp import seccomp_filter
from components.settings import SandboxLimits

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install -y bubblewrap`; Fedora: `dnf install "
    "bubblewrap`), or do not use the code reward"
)
ENV_ALLOW = ("LANG", "LC_ALL")  # the only variables copied from the parent; everything else is cleared
SLOT_UID_BASE = 60000  # leased uids: SLOT_UID_BASE .. SLOT_UID_BASE + UID_RANGE - 1
UID_RANGE = 1024
UID_LOCKS = Path(tempfile.gettempdir()) / "reinforge-sandbox-uids"
PACKAGES_DIR = "/opt/reinforge-packages"
WATCH_INTERVAL_S = 0.05
# the run's memory cgroup holds memory_mb + tmp_mb and this much for bwrap and the kernel's own pages
CGROUP_SLACK_MB = 64


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create its namespaces here: code is never run unconfined."""


@dataclass
class SandboxResult:
    """status: ok | error (non-zero exit) | timeout (wall or CPU) | memory | output_limit | processes."""

    status: str
    returncode: int
    stdout: str
    stderr: str
    wall_s: float


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            f"the code sandbox needs bubblewrap (`bwrap` is not on PATH): {INSTALL_HINT}"
        )
    return path


def _interpreter() -> str:
    """The base interpreter (a venv's python is a symlink to it)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _hidden_dirs() -> list[str]:
    """Package directories of the mounted interpreters, covered by an empty tmpfs so that nothing but the
    standard library imports (adding them to sys.path finds nothing)."""
    import sysconfig

    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    found = {sysconfig.get_paths(vars=base)["purelib"], sysconfig.get_paths(vars=base)["platlib"]}
    found |= {str(p) for p in Path(sys.base_prefix).glob("lib/python3*/site-packages")}
    found |= {str(p) for p in Path("/usr/lib").glob("python3*/dist-packages")}
    found |= {str(p) for p in Path("/usr/local/lib").glob("python3*/dist-packages")}
    found |= {str(p) for p in Path("/usr/lib").glob("python3*/site-packages")}
    base = os.path.realpath(sys.base_prefix)
    mounted = ("/usr", "/lib", base)
    return sorted(
        p for p in found if os.path.isdir(p) and any(os.path.realpath(p).startswith(m) for m in mounted)
    )


def package_dirs(names: tuple[str, ...]) -> dict[str, str]:
    """name -> the directory (or module file) of each allowed package, with numpy-style `<name>.libs`
    siblings; KeyError naming a package this environment does not have."""
    out = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or (spec.origin is None and not spec.submodule_search_locations):
            raise KeyError(name)
        path = spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin
        out[os.path.basename(path)] = path
        libs = Path(path).parent / f"{name}.libs"
        if libs.is_dir():
            out[libs.name] = str(libs)
    return out


def _ro_binds(allowed: tuple[str, ...]) -> list[str]:
    """Read-only mounts: the system libraries and the interpreter's prefix, package directories hidden, the
    allowed packages under PACKAGES_DIR."""
    paths = list(
        dict.fromkeys(["/usr", "/lib", "/lib64", "/bin", sys.base_prefix, os.path.dirname(_interpreter())])
    )
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
    for hidden in _hidden_dirs():
        args += ["--tmpfs", hidden, "--remount-ro", hidden]
    if allowed:
        args += [
            "--perms",
            "0755",
            "--dir",
            os.path.dirname(PACKAGES_DIR),
            "--perms",
            "0755",
            "--dir",
            PACKAGES_DIR,
        ]
    for name, path in package_dirs(allowed).items():
        args += ["--ro-bind", path, f"{PACKAGES_DIR}/{name}"]
    return args


@contextmanager
def uid_lease():
    """A uid no other sandbox on this machine holds while the block runs (an flock'd file per uid in
    UID_LOCKS, released when the block ends or the process dies)."""
    UID_LOCKS.mkdir(mode=0o700, parents=True, exist_ok=True)
    for uid in range(SLOT_UID_BASE, SLOT_UID_BASE + UID_RANGE):
        fd = os.open(UID_LOCKS / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            os.close(fd)
        return
    raise SandboxUnavailable(f"all {UID_RANGE} sandbox uids from {SLOT_UID_BASE} are in use")


def _tree_usage(root) -> tuple[float, int, int]:
    """(CPU seconds, resident bytes, process count) of a process and all its descendants. CPU of processes
    already reaped is in their reaper's children times (the pid namespace's init reaps orphans)."""
    import psutil

    cpu, rss, count = 0.0, 0, 0
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:  # the root is gone: nothing left to count
        return cpu, rss, count
    for proc in tree:
        try:
            t = proc.cpu_times()
            cpu += t.user + t.system + t.children_user + t.children_system
            rss += proc.memory_info().rss
            count += 1
        except psutil.Error:
            continue
    return cpu, rss, count


class _Watcher(threading.Thread):
    """Kills a run's process group when the whole tree passes a limit; `reason` says which."""

    def __init__(self, pid: int, limits: SandboxLimits, count_processes: bool):
        super().__init__(daemon=True)
        self.pid, self.limits, self.count_processes = pid, limits, count_processes
        self.reason: str | None = None
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        lim = self.limits
        while not self.done.wait(WATCH_INTERVAL_S):
            cpu, rss, count = _tree_usage(root)
            if cpu > lim.cpu_s:
                self.reason = "timeout"
            elif rss > lim.memory_mb << 20:
                self.reason = "memory"
            elif self.count_processes and count > lim.max_processes + 2:  # + bwrap and its namespace's init
                self.reason = "processes"
            if self.reason:
                _kill_group(self.pid)
                return


class Sandbox:
    """Runs code under `limits`, at most `concurrency` programs at once, each under a uid of its own."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), concurrency: int = 2):
        self.limits = limits
        self.bwrap = bwrap_path()
        try:
            self.seccomp = seccomp_filter()
        except KeyError:
            import platform

            raise SandboxUnavailable(
                f"the sandbox has no seccomp filter for this machine's architecture ({platform.machine()}); "
                "code is not run unconfined"
            ) from None
        self.as_root = os.getuid() == 0
        self._slots: queue.Queue[int] = queue.Queue()
        for slot in range(concurrency):
            self._slots.put(slot)

    def _options(self, seccomp_fd: int) -> list[str]:
        """bwrap's options, read from a pipe (`--args`): the sandbox's /proc/1/cmdline shows none of them."""
        lim = self.limits
        ns = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not self.as_root:
            ns = ["--unshare-all"]  # includes the user namespace an unprivileged bwrap needs
        env = [
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "PYTHONDONTWRITEBYTECODE",
            "1",
            "--setenv",
            "PYTHONHASHSEED",
            "0",
        ]
        for key in ENV_ALLOW:
            if key in os.environ:
                env += ["--setenv", key, os.environ[key]]
        caps = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if self.as_root else []
        return [
            *ns,
            "--die-with-parent",
            "--new-session",
            *env,
            *_ro_binds(lim.allowed_packages),
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--perms",
            "1777",
            "--size",
            str(lim.tmp_mb << 20),
            "--tmpfs",
            "/tmp",
            "--chdir",
            "/tmp",
            *caps,
            "--seccomp",
            str(seccomp_fd),
        ]

    def _prelude(self, uid: int | None) -> str:
        """Python run before anything else: the allowed packages on sys.path, then (as root) the leased uid."""
        lines = (
            [f"import sys as _s\n_s.path.append({PACKAGES_DIR!r})\ndel _s"]
            if self.limits.allowed_packages
            else []
        )
        if uid is not None:
            lines.append(f"import os as _o\n_o.setgroups([]); _o.setgid({uid}); _o.setuid({uid})\ndel _o")
        return "\n".join(lines) + "\n" if lines else ""

    def _preexec(self, nproc: int, group: MemoryCgroup | None):
        lim = self.limits

        def apply() -> None:
            if group is not None:  # bwrap and all it starts are counted from their first page
                group.join()
            mem = lim.memory_mb << 20
            for kind, value in (
                (resource.RLIMIT_AS, mem),
                (resource.RLIMIT_NPROC, nproc),
                (resource.RLIMIT_NOFILE, lim.max_open_files),
                (resource.RLIMIT_FSIZE, lim.max_output_bytes),
                (resource.RLIMIT_CORE, 0),
            ):
                resource.setrlimit(kind, (value, value))
            resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))

        return apply

    @contextmanager
    def _launch(self, python_args, pass_fds: tuple[int, ...] = ()):
        """A running sandboxed process (its Popen, its watcher) with stdout/stderr to capped files, the
        interpreter's arguments made by python_args(prelude); on leaving the block the whole group is killed
        and collect() classifies how it ended (run.result)."""
        slot = self._slots.get()
        limit = (self.limits.memory_mb + self.limits.tmp_mb + CGROUP_SLACK_MB) << 20
        try:
            with (
                uid_lease() if self.as_root else _no_uid() as uid,
                tempfile.TemporaryDirectory(prefix="reinforge-sandbox-") as tmp,
                memory_cgroup(limit) as group,
            ):
                nproc = (
                    self.limits.max_processes
                    if self.as_root
                    else _user_processes() + self.limits.max_processes
                )
                out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
                prelude = self._prelude(uid)
                with (
                    open(out_path, "wb") as out,
                    open(err_path, "wb") as err,
                    _pipe_holding(self.seccomp) as seccomp_fd,
                    _pipe_holding(_nul_joined(self._options(seccomp_fd))) as args_fd,
                ):
                    command = [self.bwrap, "--args", str(args_fd), "--", _interpreter(), "-I", "-S"]
                    proc = subprocess.Popen(
                        [*command, *python_args(prelude)],
                        stdin=subprocess.PIPE,
                        stdout=out,
                        stderr=err,
                        preexec_fn=self._preexec(nproc, group),
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=(args_fd, seccomp_fd, *pass_fds),
                        env={"PATH": "/usr/bin:/bin"},  # bwrap holds none of this process's variables
                    )
                    watcher = _Watcher(proc.pid, self.limits, count_processes=not self.as_root)
                    watcher.start()
                    run = _Run(proc, watcher, out_path, err_path, self.limits, prelude, group)
                    try:
                        yield run
                    finally:
                        watcher.done.set()
                        _kill_group(proc.pid)
                        proc.wait()
                        watcher.join()
                        run.collect()
        finally:
            self._slots.put(slot)

    def run(self, code: str) -> SandboxResult:
        """Run `code` (a Python program) and classify how it ended; never raises for what the code does."""
        with self._launch(lambda prelude: ["-"]) as run:
            try:
                run.proc.communicate((run.prelude + code).encode(), timeout=self.limits.timeout_s)
            except subprocess.TimeoutExpired:
                run.timed_out = True
        return run.result

    @contextmanager
    def session(self, code: str):
        """The program `code` loaded in a sandboxed interpreter that then answers calls (Session.call) until
        the block ends; `Session.result` tells how the process ended."""
        read_fd, write_fd = os.pipe()
        program = SESSION_BOOTSTRAP.format(fd=write_fd, max_value=MAX_VALUE_CHARS)
        try:
            with self._launch(lambda prelude: ["-c", prelude + program], pass_fds=(write_fd,)) as run:
                os.close(write_fd)  # the sandboxed program holds the only write end: EOF when it ends
                write_fd = -1
                session = Session(run, read_fd, time.monotonic() + self.limits.timeout_s)
                try:
                    session.start(code)
                    yield session
                finally:
                    session.close()
        finally:
            if write_fd >= 0:
                os.close(write_fd)
            os.close(read_fd)
        session.result = run.result


@contextmanager
def _no_uid():
    yield None


class _Run:
    """One sandboxed process and how it ended (`result`, filled in by collect())."""

    def __init__(
        self,
        proc,
        watcher: _Watcher,
        out_path: str,
        err_path: str,
        limits: SandboxLimits,
        prelude: str,
        group: MemoryCgroup | None = None,
    ):
        self.proc, self.watcher, self.limits, self.prelude, self.group = proc, watcher, limits, prelude, group
        self.out_path, self.err_path = out_path, err_path
        self.timed_out = False
        self.start = time.perf_counter()
        self.result: SandboxResult | None = None

    def collect(self) -> None:
        lim = self.limits
        stdout, out_size = _read_capped(self.out_path, lim.max_output_bytes)
        stderr, _ = _read_capped(self.err_path, lim.max_output_bytes)
        rc = self.proc.returncode
        if self.watcher.reason:
            status = self.watcher.reason
        elif self.group is not None and self.group.oom_kills():  # the cgroup's limit: every page counted
            status = "memory"
        elif self.timed_out or rc in (
            128 + signal.SIGXCPU,
            -signal.SIGXCPU,
            128 + signal.SIGKILL,
            -signal.SIGKILL,
        ):
            status = "timeout"
        elif out_size >= lim.max_output_bytes or "File too large" in stderr[-500:]:
            status = "output_limit"
        elif "MemoryError" in stderr[-2000:] or "Cannot allocate memory" in stderr[-2000:]:
            status = "memory"
        elif rc == 0:
            status = "ok"
        elif rc == 1 and stderr.startswith("bwrap:"):
            raise SandboxUnavailable(
                f"bubblewrap could not start the sandbox: {stderr.strip()[:300]}; "
                "it needs user namespaces (or root). Code is not run unconfined."
            )
        else:
            status = "error"
        self.result = SandboxResult(status, rc, stdout, stderr, time.perf_counter() - self.start)


# The program a session runs inside the sandbox. It loads the solution (the first line of stdin, JSON), then
# answers each request line {"id", "fn", "args", "kwargs"} with {"id", "value": repr(result)} or {"id",
# "raised": exception name} on the pipe `fd`, which only this process holds. Nothing it sends is trusted: the
# host parses values with ast.literal_eval, checks ids, and compares them with expected results it never sent.
SESSION_BOOTSTRAP = r"""
import ast as _ast, json as _json, os as _os, sys as _sys

def _send(message):
    _os.write({fd}, (_json.dumps(message) + "\n").encode())

_ns = {{"__name__": "__main__"}}
try:
    exec(compile(_json.loads(_sys.stdin.readline()), "<solution>", "exec"), _ns)
    _send({{"loaded": True}})
except MemoryError:
    raise  # the run ends on it: status memory
except BaseException as _e:
    _send({{"loaded": False, "error": type(_e).__name__}})
for _line in _sys.stdin:
    _request = _json.loads(_line)
    try:
        _value = _ns[_request["fn"]](*_ast.literal_eval(_request["args"]), **_ast.literal_eval(_request["kwargs"]))
        _send({{"id": _request["id"], "value": repr(_value)[:{max_value}]}})
    except MemoryError:
        raise
    except BaseException as _e:
        _send({{"id": _request["id"], "raised": type(_e).__name__}})
"""
MAX_VALUE_CHARS = 1 << 16


class SessionClosed(Exception):
    """The sandboxed program ended, or answered what was not asked: `status` says which."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


class Session:
    """Requests to a running sandboxed program and its answers, read from a pipe with the run's deadline."""

    def __init__(self, run: _Run, read_fd: int, deadline: float):
        self.run, self.read_fd, self.deadline = run, read_fd, deadline
        self.buffer = b""
        self.loaded: bool | None = None
        self.closed: str | None = None  # why the program stopped answering (then every call raises)
        self.result: SandboxResult | None = None

    def start(self, code: str) -> None:
        """Send the solution; `loaded` says whether it ran to its end without raising; `closed` why the program
        ended instead (it exited, or was killed, while loading)."""
        try:
            self._write(code)
            self.loaded = self._read().get("loaded") is True
        except SessionClosed as closed:
            self.closed = closed.status

    def _write(self, payload) -> None:
        try:
            self.run.proc.stdin.write((json.dumps(payload) + "\n").encode())
            self.run.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise SessionClosed("exited") from None

    def _read(self) -> dict:
        try:
            return self._read_message()
        except SessionClosed as closed:
            self.closed = closed.status
            raise

    def _read_message(self) -> dict:
        while b"\n" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.run.timed_out = True
                raise SessionClosed("timeout")
            ready, _, _ = select.select([self.read_fd], [], [], min(left, 0.5))
            if not ready:
                if self.run.proc.poll() is not None and not self.run.watcher.reason:
                    raise SessionClosed("exited")
                if self.run.watcher.reason:
                    raise SessionClosed(self.run.watcher.reason)
                continue
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise SessionClosed(self.run.watcher.reason or "exited")
            self.buffer += chunk
            if len(self.buffer) > 4 * MAX_VALUE_CHARS:
                raise SessionClosed("tampered")
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            raise SessionClosed("tampered") from None
        if not isinstance(message, dict):
            raise SessionClosed("tampered")
        return message

    def call(self, fn: str, args: tuple, kwargs: dict) -> tuple[str, object]:
        """("value", the result as a plain Python literal) or ("raised", exception name) or ("unplain", why);
        SessionClosed when the program ended or answered out of turn."""
        if self.closed:
            raise SessionClosed(self.closed)
        request_id = secrets.token_hex(8)
        self._write({"id": request_id, "fn": fn, "args": repr(tuple(args)), "kwargs": repr(dict(kwargs))})
        message = self._read()
        if message.get("id") != request_id:
            raise SessionClosed("tampered")
        if "raised" in message:
            return "raised", str(message["raised"])
        from components.pyparse import literal

        text = message.get("value")
        if not isinstance(text, str):
            raise SessionClosed("tampered")
        try:
            return "value", literal(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return "unplain", f"not a plain value: {text[:60]!r}"

    def close(self) -> None:
        """No more requests: the program's loop ends and it exits."""
        try:
            self.run.proc.stdin.close()
        except OSError:
            pass
        try:
            self.run.proc.wait(timeout=max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.run.timed_out = True


def _user_processes() -> int:
    uid, count = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                count += os.stat(f"/proc/{pid}").st_uid == uid
            except OSError:
                pass
    return count


@contextmanager
def _pipe_holding(data: bytes):
    """The read end of a pipe that already holds `data` (written whole, the write end closed), for a child."""
    read_fd, write_fd = os.pipe()
    try:
        if len(data) > 65536:  # a pipe's buffer: written here before the child reads, so it must fit
            raise SandboxUnavailable(f"the sandbox's arguments are {len(data)} bytes, more than a pipe holds")
        os.write(write_fd, data)
        os.close(write_fd)
        write_fd = -1
        yield read_fd
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)


def _nul_joined(args: list[str]) -> bytes:
    return b"".join(a.encode() + b"\0" for a in args)


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
