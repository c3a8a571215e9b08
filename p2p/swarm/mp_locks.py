"""Recover hivemind's process-shared locks from a DHT child that died holding one.

hivemind's MPFuture keeps three `multiprocessing.Lock`s as class attributes, created at import: one around
every result a process sends back to a future's origin, one around each process's first use of the backend,
one around allocating the shared bytes a future's state lives in. Every process forked afterwards shares
them. A DHT child ended while it holds one (a SIGTERM to the process group in mid-write; a SIGKILL after the
grace period; a test simulating a crash) leaves it held for good, and the next DHT child forked from the same
parent blocks on its very first result, the "ready" signal: its start waits out the whole timeout, and so
does every later one in that process. This is what made whole runs of swarm tests hang minutes per test.

A live holder releases its lock within a pipe write, so a lock not acquired within a second before the next
fork is one a dead process holds: it is replaced by a fresh one, which that child and later ones use. The
children still on the old lock are the ones stuck behind the dead holder already.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from typing import Any

from hivemind.utils.mpfuture import MPFuture, SharedBytes

logger = logging.getLogger(__name__)

HELD_LOCK_WAIT_S = 1.0
# (owner class, attribute) of every process-shared lock hivemind's futures take.
SHARED_LOCKS: tuple[tuple[Any, str], ...] = (
    (MPFuture, "_update_lock"),
    (MPFuture, "_initialization_lock"),
    (SharedBytes, "_lock"),
)


def replace_locks_held_by_the_dead(wait_s: float = HELD_LOCK_WAIT_S) -> list[str]:
    """Before forking a DHT child: replace each shared lock not acquired within `wait_s` (see the module
    docstring). Returns the names of the replaced locks."""
    replaced = []
    for owner, attribute in SHARED_LOCKS:
        lock = getattr(owner, attribute)
        if lock.acquire(timeout=wait_s):
            lock.release()
            continue
        setattr(owner, attribute, mp.Lock())
        replaced.append(f"{owner.__name__}.{attribute}")
    if replaced:
        logger.warning(
            "hivemind's %s held by a process that died holding it (a DHT child ended mid-write): the "
            "next DHT child uses a fresh lock",
            ", ".join(replaced),
        )
    return replaced
