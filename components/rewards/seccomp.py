"""The seccomp filter the code sandbox runs under (bubblewrap's `--seccomp FD`): a classic BPF program, built
here without libseccomp, that denies what sandboxed code never needs and could use to escape its limits.

Denied with EPERM: new namespaces (unshare, setns, and clone with a CLONE_NEW* flag), mounts (mount, umount2,
pivot_root, the new mount API), SysV shared memory and message queues, POSIX message queues, memfd_create
(each holds memory that no process's resident size counts), keyrings, bpf, userfaultfd, perf_event_open,
kernel modules and kexec. clone3 gets ENOSYS, so the C library falls back to clone, whose flags the filter can
read (clone3 passes them in memory a filter cannot). Any other architecture's calling convention (32-bit
calls on x86_64, x32) kills the process: the table below holds only the native numbers.

Layout of seccomp_data (linux/seccomp.h): nr at byte 0, arch at 4, instruction pointer at 8, args at 16.
"""

from __future__ import annotations

import errno
import platform
import struct

# linux/filter.h instruction codes
LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
RET_K = 0x06  # BPF_RET | BPF_K
# linux/seccomp.h actions
ALLOW, ERRNO, KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000

CLONE_NEW = (
    0x10000000 | 0x00020000 | 0x40000000 | 0x20000000 | 0x08000000 | 0x04000000 | 0x02000000 | 0x00000080
)
# user, mount, net, pid, ipc, uts, cgroup, time
X32_BIT = 0x40000000

# per architecture: the audit arch, then the syscall numbers (native ABI) of clone, clone3 and the denied ones
ARCHES = {
    "x86_64": (
        0xC000003E,
        56,
        435,
        {
            "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "open_tree": 428,
            "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
            "mount_setattr": 442, "shmget": 29, "shmat": 30, "msgget": 68, "mq_open": 240,
            "memfd_create": 319, "memfd_secret": 447, "keyctl": 250, "add_key": 248, "request_key": 249,
            "bpf": 321, "userfaultfd": 323, "perf_event_open": 298, "init_module": 175,
            "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
            "ptrace": 101, "process_vm_writev": 311, "open_by_handle_at": 304, "swapon": 167,
        },
    ),
    "aarch64": (
        0xC00000B7,
        220,
        435,
        {
            "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "open_tree": 428,
            "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
            "mount_setattr": 442, "shmget": 194, "shmat": 196, "msgget": 186, "mq_open": 180,
            "memfd_create": 279, "memfd_secret": 447, "keyctl": 219, "add_key": 217, "request_key": 218,
            "bpf": 280, "userfaultfd": 282, "perf_event_open": 241, "init_module": 105,
            "finit_module": 273, "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294,
            "ptrace": 117, "process_vm_writev": 271, "open_by_handle_at": 265, "swapon": 224,
        },
    ),
}  # fmt: skip


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)  # struct sock_filter


def denied_calls(machine: str | None = None) -> list[str]:
    return sorted(ARCHES[machine or platform.machine()][3])


def seccomp_filter(machine: str | None = None) -> bytes:
    """The filter for this machine's architecture, as bwrap reads it (struct sock_filter[], native order).
    KeyError on an architecture without a table (the sandbox then refuses to run)."""
    machine = machine or platform.machine()
    arch, clone, clone3, denied = ARCHES[machine]
    numbers = sorted(denied.values())
    # instruction indices, so jumps are relative: the tail is [allow, deny, enosys, kill]
    head = 4 if machine == "x86_64" else 3  # x86_64 has one more check: the x32 ABI
    checks = len(numbers) + 2  # each denied number, then clone and clone3
    body_end = head + checks
    allow, deny, enosys, kill = body_end + 2, body_end + 3, body_end + 4, body_end + 5
    prog = [_insn(LD_W_ABS, 4)]  # arch
    prog.append(_insn(JEQ_K, arch, 0, kill - 2))  # another architecture's convention: kill
    prog.append(_insn(LD_W_ABS, 0))  # nr
    if head == 4:  # x86_64: the x32 ABI sets bit 30 of the number
        prog.append(_insn(JGE_K, X32_BIT, kill - 4, 0))
    for nr in numbers:
        here = len(prog)
        prog.append(_insn(JEQ_K, nr, deny - here - 1, 0))
    here = len(prog)
    prog.append(_insn(JEQ_K, clone3, enosys - here - 1, 0))
    here = len(prog)
    prog.append(_insn(JEQ_K, clone, 0, allow - here - 1))  # clone: read its flags below
    prog.append(_insn(LD_W_ABS, 16))  # args[0], low 32 bits: the flags
    here = len(prog)
    prog.append(_insn(JSET_K, CLONE_NEW, deny - here - 1, 0))
    prog += [
        _insn(RET_K, ALLOW),
        _insn(RET_K, ERRNO | errno.EPERM),
        _insn(RET_K, ERRNO | errno.ENOSYS),
        _insn(RET_K, KILL_PROCESS),
    ]
    return b"".join(prog)
