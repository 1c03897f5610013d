"""A memory cgroup per sandboxed run, where the machine lets this process make one (cgroup v2, or v1's memory
controller): it counts every page the run causes, files in its tmpfs, shared memory and page cache included,
which a sum of resident sizes misses, and the kernel stops the run at the limit. Where no cgroup can be made,
the sandbox's seccomp filter and tmpfs size hold that memory instead (components/rewards/sandbox.py).
"""

from __future__ import annotations

import itertools
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
_runs = itertools.count()


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    v2: bool

    def join(self) -> None:
        """Move the calling process into the cgroup (called in the child, before it runs the sandbox)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> int:
        name = "memory.current" if self.v2 else "memory.usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        """How many processes the kernel killed at the limit."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            lines = (self.path / name).read_text().split("\n")
        except OSError:
            return 0
        return sum(int(line.split()[1]) for line in lines if line.startswith("oom_kill "))


def own_memory_cgroup() -> tuple[Path, bool] | None:
    """This process's memory cgroup directory and whether it is v2; None where there is none to write."""
    try:
        lines = Path("/proc/self/cgroup").read_text().split("\n")
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            return ROOT / "memory" / parts[2].lstrip("/"), False
    for line in lines:
        if line.startswith("0::") and (ROOT / "cgroup.controllers").is_file():
            return ROOT / line[3:].lstrip("/"), True
    return None


@contextmanager
def memory_cgroup(limit_bytes: int):
    """A fresh child cgroup of this process's own, limited to `limit_bytes` with no swap; yields None where the
    machine does not allow one. Removed when the block ends (its processes are gone by then)."""
    own = own_memory_cgroup()
    group = None
    if own is not None:
        parent, v2 = own
        path = parent / f"reinforge-sandbox-{os.getpid()}-{next(_runs)}"
        try:
            path.mkdir()
            if v2:
                (path / "memory.max").write_text(str(limit_bytes))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                if (path / "memory.memsw.limit_in_bytes").exists():
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            group = MemoryCgroup(path, v2)
        except OSError:  # not ours to write (a container without delegation): the fallback holds
            _remove(path)
    try:
        yield group
    finally:
        if group is not None:
            _remove(group.path)


def _remove(path: Path) -> None:
    """rmdir, retried for a moment: the kernel frees a cgroup a little after its last process is reaped."""
    import time

    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
