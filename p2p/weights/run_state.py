"""What the parts of one shard run share: the fetch it serves, its queue, its attempts in flight, its tallies.

A shard run (shardrun.py) is a scheduler (scheduler.py) handing shards to attempts (attempt_runner.py), with
availability records kept by peering.py and charges by outcomes.py. They all read and change this one state,
on the event loop only: worker threads reach it through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .attempts import Attempt
from .connections import ConnectionPool
from .fetch_settings import FetchSettings
from .manifest import SignedManifest
from .outcomes import Outcomes
from .peering import Peering
from .rarest import ShardQueue
from .sources import SourcePool
from .store import PartialVersion, Store

HEDGE_DIR = ".hedges"  # side files of hedged copies, inside the partial version; removed before it is moved


@dataclass(frozen=True)
class FetchContext:
    """What a shard run needs of the fetch that started it (fetch.py builds one per version)."""

    settings: FetchSettings
    store: Store
    connections: ConnectionPool
    on_bytes: Callable[[int], None] | None = None  # each chunk's size, on the event loop (progress bars)
    on_shard: Callable[[int], None] | None = None  # each shard index once it verified (relays advertise it)
    # (manifest, bytes resumed), at the start.
    on_manifest: Callable[[SignedManifest, int], None] | None = None
    # Asks a source for the manifest being fetched (a peer that did not hold it yet may join); None: never.
    ask_manifest: Callable[[str], asyncio.Task[SignedManifest]] | None = None


class RunState:
    """The shared state of one shard run; see the module docstring."""

    def __init__(
        self,
        context: FetchContext,
        partial: PartialVersion,
        pool: SourcePool,
        joining: dict[str, asyncio.Task[SignedManifest]] | None = None,
        absent: set[str] | None = None,
        wanted: frozenset[int] | None = None,
    ) -> None:
        self.ctx = context
        self.settings = context.settings
        self.partial = partial
        self.manifest = partial.manifest
        self.shards = self.manifest.body.shards
        self.pool = pool
        self.joining = dict(joining or {})  # manifest requests still running: their sources may join
        # The shards this run is to hold: every one, or a selection (selection.py); the rest are never asked for.
        self.wanted = frozenset(range(len(self.shards))) if wanted is None else wanted
        self.queue = ShardQueue((i for i in sorted(self.wanted) if i not in partial.done), len(self.shards))
        self.inflight: dict[int, list[Attempt]] = {}
        self.tried: dict[int, set[str]] = collections.defaultdict(set)
        self.asked: set[str] = set()  # sources asked for some shard in this fetch
        self.winners: set[int] = set()  # shards whose first verified copy is being (or has been) kept
        self.reported = {i: p.done_bytes for i, p in partial.progress.items()}  # bytes passed to on_bytes
        self.delayed = 0  # shards waiting out a relay's Retry-After before they are queued again
        self.received = self.hedges = self.hedges_won = self.serial = 0
        # Selected bytes already verified on disk, + prefixes a winning copy continued.
        self.resumed = sum(self.shards[i].size for i in partial.done if i in self.wanted)
        self.error: BaseException | None = None  # our own failure (the disk, a bug): the run stops with it
        self.dirty = False  # progress changed since the journal last saved it
        self.changed = asyncio.Event()  # wakes the scheduler
        self.cancelled = threading.Event()  # transfer threads stop at their next chunk
        self.hedge_dir = partial.directory / HEDGE_DIR
        # Each attempt holds a thread: `concurrency` for proven sources, as many for probes, as many slow ones
        # (scheduler.py), and one to move hedged copies into place.
        self.threads = ThreadPoolExecutor(
            max_workers=3 * self.settings.concurrency + 1, thread_name_prefix="weights-shard"
        )
        self.loop = asyncio.get_running_loop()
        self.started = time.monotonic()
        for task in self.joining.values():
            task.add_done_callback(lambda _t: self.changed.set())
        self.peering = Peering(
            self.settings,
            context.connections,
            self.manifest,
            pool,
            self.queue,
            absent=absent or set(),
            ask_manifest=context.ask_manifest,
            on_change=self.changed.set,
            on_join=self._join,
        )
        self.outcomes = Outcomes(
            pool, self.settings, self.manifest.step, len(self.manifest.body.shards), on_drop=self.peering.drop
        )

    def _join(self, url: str, task: asyncio.Task[SignedManifest]) -> None:
        self.joining[url] = task
        task.add_done_callback(lambda _t: self.changed.set())

    def holds_wanted(self) -> bool:
        return self.wanted.issubset(self.partial.done)

    def attempts(self) -> list[Attempt]:
        return [a for attempts in self.inflight.values() for a in attempts]

    def requeue(self, index: int, delay: float, *, first: bool = True) -> None:
        """Queue shard `index` again, now or after `delay` seconds (a relay's Retry-After)."""
        if delay <= 0:
            self.queue.put_back(index, first=first)
            return
        self.delayed += 1

        def back() -> None:
            self.delayed -= 1
            self.queue.put_back(index, first=first)
            self.changed.set()

        self.loop.call_later(delay, back)
