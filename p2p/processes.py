"""Process helpers shared by the swarm, the daemon and the devnet: liveness by PID, children, ending them.

They read /proc directly (Linux), so no third-party process library is needed, and they treat a zombie as
dead: it has exited and only its parent's wait() is missing.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def child_pids(parent: int) -> list[int]:
    """PIDs whose parent is `parent` (read from /proc; no third-party process library needed)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name (field 2) may contain spaces, so split after ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            found.append(int(entry.name))
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; only its parent's wait() is missing
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split() or ["?"])[0] != "Z"
    except OSError:
        return False


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
