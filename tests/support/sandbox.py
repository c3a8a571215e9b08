"""Helpers for the sandbox tests (tests/test_sandbox.py, tests/test_code_env.py).

`sandbox_skip_reason` says why sandboxed tests cannot run here (None when they can). `SandboxWatch`
records the pid namespaces of this process's sandboxes while they run and then checks that nothing is
left in them: a program that escaped its wall-clock kill would still be there. `without_namespaces`
runs a command the way a default Docker container would (seccomp refusing new namespaces), so that the
"no working sandbox" path is tested with a real bwrap failing for real.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from prime_node.node.environments.sandbox import SandboxUnavailable, check_sandbox


def sandbox_skip_reason() -> str | None:
    try:
        check_sandbox()
    except SandboxUnavailable as exc:
        return f"no working sandbox here: {exc}"
    return None


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def processes_in(namespaces: set[str]) -> list[int]:
    """Processes still running in any of `namespaces` (links like 'pid:[4026532181]'). Not zombies: bwrap
    exits once its init has reported the program's status, and the init's zombie is then reaped by the
    host's init like any orphan (promptly where that is systemd; slowly on this test container)."""
    found = []
    for pid in psutil.pids():
        if _pid_namespace(pid) in namespaces and _running(pid):
            found.append(pid)
    return found


class SandboxWatch:
    """While active, polls the descendants of `root` (default: this process) and records the pid namespaces
    other than ours that they run in, i.e. the sandboxes; `leftovers` waits for those to empty."""

    def __init__(self, root: int | None = None) -> None:
        self.root = psutil.Process(root or os.getpid())
        self.own = _pid_namespace(os.getpid())
        self.namespaces: set[str] = set()
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="sandbox-watch", daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                children = self.root.children(recursive=True)
            except psutil.Error:
                children = []
            for child in children:
                namespace = _pid_namespace(child.pid)
                if namespace is not None and namespace != self.own:
                    self.namespaces.add(namespace)
                    self.pids.add(child.pid)
            self._stop.wait(0.005)

    def __enter__(self) -> SandboxWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def leftovers(self, within_s: float = 5.0) -> list[int]:
        """Processes still alive in the recorded sandboxes after `within_s` seconds (killed, then listed)."""
        deadline = time.monotonic() + within_s
        while (left := processes_in(self.namespaces)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in left:  # leave the host clean even when the test fails
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        return left


@contextmanager
def watch_sandboxes(root: int | None = None) -> Iterator[SandboxWatch]:
    with SandboxWatch(root) as watch:
        yield watch


# Docker's default seccomp profile, the part that matters here: unshare and namespace-creating clones
# are refused (EPERM) and clone3 reported missing (ENOSYS, so that libc falls back to clone). x86_64 only.
_CLONE_NAMESPACES = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
_NR_CLONE, _NR_UNSHARE, _NR_CLONE3 = 56, 272, 435


def _no_namespaces_filter() -> bytes:
    def insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS
    return b"".join(
        [
            insn(ld, 0),  # 0: syscall number
            insn(jeq, _NR_UNSHARE, jt=6),  # 1 -> 8 (EPERM)
            insn(jeq, _NR_CLONE3, jt=4),  # 2 -> 7 (ENOSYS)
            insn(jeq, _NR_CLONE, jf=2),  # 3 -> 4, else 6 (ALLOW)
            insn(ld, 16),  # 4: clone flags (low 32 bits of args[0])
            insn(jset, _CLONE_NAMESPACES, jt=2),  # 5 -> 8 (EPERM)
            insn(ret, allow),  # 6
            insn(ret, enosys),  # 7
            insn(ret, eperm),  # 8
        ]
    )


def without_namespaces_main(argv: list[str]) -> None:
    """`python -m support.sandbox CMD...`: exec CMD where no namespace can be created."""
    program = _no_namespaces_filter()
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(program)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")
    os.execv(argv[0], argv)


if __name__ == "__main__":
    without_namespaces_main(sys.argv[1:])
