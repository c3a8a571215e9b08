"""One attempt at one shard from one source, and the judgement of whether it is too slow to wait for.

An attempt writes either in place (into the partial version's files, resumable with Range) or, when another
attempt at the same shard already writes in place, into a side file of its own: two copies of a shard in
flight (a hedge) never write the same bytes, so the copy that verifies is exactly the bytes that were hashed.
A winning side copy is moved into place only after the in-place attempt's thread has stopped.

An attempt is *slow* when it would finish much later than the same shard fetched afresh from the best other
source: after that source's time for a whole shard, its projected remaining time exceeds `hedge_ratio` times
it. With no other source measured yet, it is slow when, after `hedge_after_s`, its rate is below the
throughput floor. A slow attempt keeps running (it may still win) but stops holding a worker slot, and its
shard is offered to another source.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import StoreError
from .sources import SourceState
from .store import PartialVersion
from .watchdog import Watch

if TYPE_CHECKING:
    from .fetch import FetchSettings

MIN_JUDGE_S = 0.04  # no attempt is judged before this: below it, thread scheduling noise dominates


@dataclass(eq=False)
class Attempt:
    """A transfer of one shard from one source, in flight."""

    index: int
    source: SourceState
    size: int  # the shard's size
    start: int  # first byte asked for (bytes before it were on disk already)
    watch: Watch
    side_path: Path | None = None  # None: writes in place
    slow: bool = False  # judged too slow: holds no worker slot, its shard may be hedged
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def in_place(self) -> bool:
        return self.side_path is None


def is_slow(attempt: Attempt, best_bandwidth: float | None, now: float, settings: FetchSettings) -> bool:
    """Whether `attempt` is much slower than fetching its shard afresh elsewhere (see the module docstring)."""
    age = now - attempt.watch.started
    got = attempt.watch.received
    if best_bandwidth is None:
        return age >= settings.hedge_after_s and got < settings.min_rate_bytes_s * age
    elsewhere = attempt.size / best_bandwidth  # a whole shard from the best other source
    if age < max(elsewhere, MIN_JUDGE_S):
        return False
    if got <= 0:
        return True
    remaining = (attempt.size - attempt.start - got) * age / got
    return remaining > settings.hedge_ratio * elsewhere


def side_writer(path: Path) -> tuple[int, Any]:
    """Open a hedge's side file (in the transfer thread); returns its fd and a sink writing into it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot create {path}: {exc}") from exc
    return fd, lambda offset, data: os.pwrite(fd, data, offset)


def install_side(partial: PartialVersion, attempt: Attempt) -> None:
    """Copy a verified side copy into the partial version (blocking; after the in-place writer stopped)."""
    assert attempt.side_path is not None
    try:
        with open(attempt.side_path, "rb") as f:
            offset = 0
            while offset < attempt.size:
                block = f.read(min(8 << 20, attempt.size - offset))
                if not block:
                    raise StoreError(f"{attempt.side_path} is shorter than the shard it verified")
                partial.write(attempt.index, offset, block)
                offset += len(block)
    except OSError as exc:
        raise StoreError(f"cannot move a verified copy of shard {attempt.index} into place: {exc}") from exc


def fresh_hasher() -> Any:
    return hashlib.sha256()
