"""One attempt at one shard from one source: where it writes, where it starts, whether it is too slow.

An attempt writes either in place (into the partial version's files, resumable with Range) or, when another
attempt at the same shard already writes in place, into a side file of its own: two copies of a shard in
flight (a hedge) never write the same bytes, so the copy that verifies is exactly the bytes that were hashed.
A winning side copy is moved into place only after the in-place attempt's thread has stopped.

Where an in-place attempt starts (`resume_point`): a shard's bytes on disk are continued only by the source
that sent them. The SHA-256 of a shard covers every byte of it, so bytes of one source completed by another's
cannot be judged: a source that answers a correct head, sends garbage and hangs up would otherwise make the
next, honest, source's copy fail its digest and be charged for it. A prefix that another source wrote is
simply overwritten from byte 0.

An attempt is *slow* when it would finish much later than the same shard fetched afresh from the best other
source: after that source's time for a whole shard, its projected remaining time exceeds `hedge_ratio` times
it. With no other source measured yet, it is slow when, after `hedge_after_s`, its rate is below the
throughput floor. A slow attempt keeps running (it may still win) but stops holding a worker slot, and its
shard is offered to another source.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import StoreError
from .fetch_settings import FetchSettings
from .sources import SourceState
from .store import PartialVersion, ShardProgress
from .watchdog import Watch

MIN_JUDGE_S = 0.04  # no attempt is judged before this: below it, thread scheduling noise dominates


@dataclass(frozen=True)
class Recheck:
    """A resumed copy of a shard failed its digest: the same source is asked for the whole shard before anyone
    is charged. `journaled`: the prefix came from an earlier run, so the mismatch may be our disk's."""

    prefix_bytes: int  # how much of the failed copy was resumed from disk
    journaled: bool
    reason: str  # what the resumed copy's failure said


@dataclass(eq=False)
class Attempt:
    """A transfer of one shard from one source, in flight."""

    index: int
    source: SourceState
    size: int  # the shard's size
    start: int  # first byte asked for (bytes before it were on disk already, all sent by this source)
    watch: Watch
    side_path: Path | None = None  # None: writes in place
    progress: ShardProgress | None = None  # the in-place copy's progress (its writer is this source)
    recheck: Recheck | None = None  # set when this attempt refetches a shard whose resumed copy failed
    slow: bool = False  # judged too slow: holds no worker slot, its shard may be hedged
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def in_place(self) -> bool:
        return self.side_path is None

    @property
    def resumed(self) -> bool:
        return self.start > 0


def resume_point(held: ShardProgress | None, source: str) -> int:
    """The byte an in-place attempt from `source` starts at: the end of the prefix on disk when `source` wrote
    all of it, else 0 (the prefix is overwritten)."""
    if held is None or held.writer != source:
        return 0
    return held.done_bytes


def is_slow(attempt: Attempt, best_bandwidth: float | None, now: float, settings: FetchSettings) -> bool:
    """Whether `attempt` is much slower than fetching its shard afresh elsewhere (see the module docstring)."""
    return judge_at(attempt, best_bandwidth, settings) <= now and _too_slow(
        attempt, best_bandwidth, now, settings
    )


def judge_at(attempt: Attempt, best_bandwidth: float | None, settings: FetchSettings) -> float:
    """The earliest time `attempt` can be judged slow (the scheduler wakes then rather than on a tick)."""
    if best_bandwidth is None:
        return attempt.watch.started + settings.hedge_after_s
    return attempt.watch.started + max(attempt.size / best_bandwidth, MIN_JUDGE_S)


def next_judgment(attempt: Attempt, best_bandwidth: float | None, settings: FetchSettings) -> float:
    """The earliest time `attempt` can be found slow if no further byte arrives: the scheduler sleeps until
    then instead of judging every attempt on a fixed tick. Bytes that do arrive only move that time later
    (the projection below improves with every byte), so waking then and judging again misses nothing; a
    new bandwidth measurement (which can move it earlier) comes with an attempt's end, which wakes the
    scheduler anyway. Solves `_too_slow` for the age at which it turns true with `received` held fixed."""
    first = judge_at(attempt, best_bandwidth, settings)
    got = attempt.watch.received
    if best_bandwidth is None:  # slow once its average rate falls under the floor
        return max(first, attempt.watch.started + got / settings.min_rate_bytes_s)
    left = attempt.size - attempt.start - got
    if got <= 0:
        return first
    if left <= 0:
        return math.inf  # every byte is in: it is being verified, never slow
    budget = settings.hedge_ratio * attempt.size / best_bandwidth  # the remaining time it may project
    return max(first, attempt.watch.started + budget * got / left)


def _too_slow(attempt: Attempt, best_bandwidth: float | None, now: float, settings: FetchSettings) -> bool:
    age = now - attempt.watch.started
    got = attempt.watch.received
    if best_bandwidth is None:
        return got < settings.min_rate_bytes_s * age
    if got <= 0:
        return True
    remaining = (attempt.size - attempt.start - got) * age / got
    return remaining > settings.hedge_ratio * attempt.size / best_bandwidth


def side_writer(path: Path) -> tuple[int, Callable[[int, memoryview], Any]]:
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
