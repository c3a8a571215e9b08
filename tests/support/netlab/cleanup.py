"""Names of what the harness makes, and removal of what a crashed test left behind.

Every namespace is named `pnl<pid>x<n>-<name>`: FAMILY, the PID of the process that made it, a counter.
Links live inside these namespaces (veth pairs are created directly in them), so deleting a namespace
deletes its links; nothing is made in the root namespace. A namespace whose maker is no longer alive is a
leftover: `remove_leftovers` ends the processes still inside it (they were started there by the harness,
found by `ip netns pids`, ended by PID) and deletes it. Namespaces of live makers, e.g. another test
session running side by side, are left alone.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time

from .commands import FAMILY, NetlabError, run

logger = logging.getLogger(__name__)

_NAME = re.compile(rf"^{FAMILY}(?P<pid>\d+)x\d+-")


def owned_namespaces(prefix: str = FAMILY) -> list[str]:
    """Namespaces whose name starts with `prefix` (by default: every one the harness made, anyone's)."""
    listing = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in listing.splitlines() if line.startswith(prefix)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ns_pids(ns: str) -> list[int]:
    return [int(p) for p in run(["ip", "netns", "pids", ns], check=False).split() if p.isdigit()]


def remove_namespaces(names: list[str], grace_s: float = 5.0) -> None:
    """End the processes inside `names` (SIGTERM, then SIGKILL after `grace_s`), then delete them."""
    pids = {pid for ns in names for pid in ns_pids(ns)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if _alive(pid)}
            time.sleep(0.1)
        if not pids:
            break
    for ns in names:
        try:
            run(["ip", "netns", "del", ns])
        except NetlabError as exc:
            logger.warning("could not remove namespace %s: %s", ns, exc)


def remove_leftovers() -> list[str]:
    """Remove every harness namespace whose maker has exited; the names removed."""
    dead = []
    for ns in owned_namespaces():
        match = _NAME.match(ns)
        if match is not None and not _alive(int(match["pid"])):
            dead.append(ns)
    if dead:
        logger.info("removing %d namespaces left by a crashed test: %s", len(dead), dead)
        remove_namespaces(dead)
    return dead
