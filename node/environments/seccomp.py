"""The sandbox's seccomp filter: a few system calls a sandboxed program never needs are refused (EPERM).

bubblewrap already takes away capabilities, the network and further user namespaces; this closes what a
process may still do to its neighbours and to the kernel as an ordinary user:
- ptrace, process_vm_readv/writev, pidfd_getfd, kcmp: reach into another process of the same user. In the
  sandbox that is bwrap's init (pid 1), whose death signal is what kills the sandbox when its scorer dies;
  a program that could attach to it could clear that and outlive the scorer.
- bpf, userfaultfd, perf_event_open, io_uring_*: large kernel interfaces that exploits favour and that no
  test program needs (Docker's default profile refuses most of them for the same reason).
- add_key, request_key, keyctl: the kernel keyrings, which are not namespaced like the rest.

The filter is classic BPF (struct sock_filter, native byte order) as `bwrap --seccomp FD` reads it. Other
architectures than x86_64 and aarch64 have no filter here, so the sandbox refuses to start on them.
"""

from __future__ import annotations

import errno
import platform
import struct

# Each architecture's audit number and the numbers of the refused system calls (from the kernel's
# asm/unistd_64.h for x86_64, asm-generic/unistd.h for aarch64).
_REFUSED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "bpf",
    "userfaultfd",
    "perf_event_open",
    "add_key",
    "request_key",
    "keyctl",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
)
_ARCHITECTURES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        dict(zip(_REFUSED, (101, 310, 311, 312, 438, 321, 323, 298, 248, 249, 250, 425, 426, 427))),
    ),
    "aarch64": (
        0xC00000B7,
        dict(zip(_REFUSED, (117, 270, 271, 272, 438, 280, 282, 241, 217, 218, 219, 425, 426, 427))),
    ),
}
_X32_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers, refused wholesale

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_EPERM = 0x00050000 | errno.EPERM
_OFFSET_NR, _OFFSET_ARCH = 0, 4  # struct seccomp_data


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The compiled filter for `machine` (default: this one), or None where there is none."""
    arch = _ARCHITECTURES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, numbers = arch
    refused = sorted(numbers.values())
    program = [
        _insn(_LD_W_ABS, _OFFSET_ARCH),
        _insn(_JEQ_K, audit_arch, jt=1),  # another ABI (i386 via int 0x80): its numbers mean other calls
        _insn(_RET_K, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, _OFFSET_NR),
    ]
    # Jumps are relative to the next instruction; the EPERM return is the last one, after the ALLOW.
    if audit_arch == _ARCHITECTURES["x86_64"][0]:
        program.append(_insn(_JSET_K, _X32_BIT, jt=len(refused) + 1))
    for index, number in enumerate(refused):
        program.append(_insn(_JEQ_K, number, jt=len(refused) - index))
    program += [_insn(_RET_K, _RET_ALLOW), _insn(_RET_K, _RET_EPERM)]
    return b"".join(program)
