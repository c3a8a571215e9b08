"""Process helpers shared by the swarm, the daemon and the devnet: liveness by PID, children, ending them.

They ask psutil (the process table of every platform it supports, instead of parsing /proc by hand), and
treat a zombie as dead: it has exited and only its parent's wait() is missing.
"""

from __future__ import annotations

import os
import signal
import time

import psutil


def child_pids(parent: int) -> list[int]:
    """PIDs whose parent is `parent` (none when `parent` is gone)."""
    try:
        return [child.pid for child in psutil.Process(parent).children()]
    except psutil.NoSuchProcess:
        return []


def pid_alive(pid: int) -> bool:
    try:  # a zombie has exited; only its parent's wait() is missing
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # another user's process: it exists


def end_pids(pids: list[int], grace_s: float) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL whichever of `pids` are still alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [pid for pid in pids if pid_alive(pid)]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [pid for pid in alive if pid_alive(pid)]
        if not alive:
            return
