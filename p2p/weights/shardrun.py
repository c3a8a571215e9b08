"""The shard phase of a fetch: a scheduler that spreads shards over sources, hedges slow ones, and verifies.

One loop on the event loop starts attempts (attempts.py) while there is a free slot: `concurrency` slots for
sources that have verified a shard in this fetch, as many for probes (one shard at a time per source not
proven yet; a source's first probe does not wait for a slot). The next shard is the rarest one some free
source holds (rarest.py, from the sources' signed availability records kept by peering.py), and it goes to a
source drawn by weight (sources.py) among those that hold it; a source with a slow attempt in flight gets no
more. When no source claims any waiting shard, the first one is asked of any source, as before availability
records existed (a 503 there is "not verified yet", not a fault); a source that claimed a shard and answers
503 or 404 for it has lied, and is demoted. An attempt judged slow gives up
its slot, and its shard is also asked of another source (a hedge): the first copy that verifies wins, and
the other is cut at its next chunk boundary and charged its measured rate. Once every shard has been asked
for (the end game), a proven source's free slot also takes a shard held only by unproven sources. The loop
wakes when an attempt ends and when the next attempt in flight can first be judged slow, not on a fixed tick.

Each attempt's failure is charged to its source alone (outcomes.py) and the shard goes back to the queue; the
fetch fails only when every usable source has failed a shard at least once and `max_attempts_per_shard`
failures are reached. Verified shards are kept even then: they match the signed manifest whoever sent them,
and a rerun fetches only what is missing. Sources whose manifest arrives after the fetch started join when it
is the manifest being fetched.

Every exit path, success or not, cuts the transfers in flight and waits for their threads before the partial
version's files are closed, so no thread ever writes to a closed (or reused) file descriptor.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .attempts import (
    Attempt,
    Recheck,
    fresh_hasher,
    install_side,
    is_slow,
    judge_at,
    resume_point,
    side_writer,
)
from .connections import ConnectionPool
from .errors import FetchError, ManifestAbsent, ManifestError, SourceError
from .fetch_settings import FetchSettings
from .manifest import SignedManifest, checkpoint_digest
from .outcomes import Outcomes
from .peering import Peering
from .rarest import ShardQueue
from .result import FetchResult
from .sources import SourcePool, SourceState
from .store import PartialVersion, ShardProgress, Store
from .transfer import ShardFailure, ShardResult, TransferCancelled, download_shard, rehash, shard_path
from .watchdog import Watch

logger = logging.getLogger(__name__)

SCHEDULE_TICK_S = 0.02  # how often transfers in flight that are sending are judged again
MAX_IDLE_S = 0.25  # the longest the loop sleeps with nothing to judge (late manifests are polled that often)
MAX_SCAN = 64  # waiting shards looked at for one free source, rarest first (bounds the scheduler's work)
MAX_COPIES = 3  # transfers of one shard at once: the first, and up to two hedges when each before is slow
HEDGE_DIR = ".hedges"  # side files of hedged copies, inside the partial version; removed before it is moved


@dataclass(frozen=True)
class FetchContext:
    """What a shard run needs of the fetch that started it (fetch.py builds one per version)."""

    settings: FetchSettings
    store: Store
    connections: ConnectionPool
    on_bytes: Callable[[int], None] | None = None  # each chunk's size, on the event loop (progress bars)
    on_shard: Callable[[int], None] | None = None  # each shard index once it verified (relays advertise it)
    on_manifest: Callable[[SignedManifest, int], None] | None = (
        None  # (manifest, bytes resumed), at the start
    )
    # Asks a source for the manifest being fetched (a peer that did not hold it yet may join); None: never.
    ask_manifest: Callable[[str], asyncio.Task[SignedManifest]] | None = None


class ShardRun:
    """Downloads the missing shards of one partial version and moves it into place when all verified."""

    def __init__(
        self,
        context: FetchContext,
        partial: PartialVersion,
        pool: SourcePool,
        joining: dict[str, asyncio.Task[SignedManifest]] | None = None,
        absent: set[str] | None = None,
    ) -> None:
        self.ctx = context
        self.settings = context.settings
        self.partial = partial
        self.manifest = partial.manifest
        self.shards = self.manifest.body.shards
        self.pool = pool
        self.joining = dict(joining or {})  # manifest requests still running: their sources may join
        self.queue = ShardQueue(
            (i for i in range(len(self.shards)) if i not in partial.done), len(self.shards)
        )
        self.inflight: dict[int, list[Attempt]] = {}
        self.tried: dict[int, set[str]] = collections.defaultdict(set)
        self.asked: set[str] = set()  # sources asked for some shard in this fetch
        self.winners: set[int] = set()  # shards whose first verified copy is being (or has been) kept
        self.reported = {i: p.done_bytes for i, p in partial.progress.items()}  # bytes passed to on_bytes
        self.delayed = 0  # shards waiting out a relay's Retry-After before they are queued again
        self.outcomes = Outcomes(
            pool, self.settings, self.manifest.step, on_drop=lambda s: self.peering.drop(s)
        )
        self.received = self.hedges = self.hedges_won = self._serial = 0
        self.resumed = sum(self.shards[i].size for i in partial.done)  # + prefixes a winning copy continued
        self.error: BaseException | None = None
        self.dirty = False
        self.changed = asyncio.Event()
        self.cancelled = threading.Event()
        self.hedge_dir = partial.directory / HEDGE_DIR
        # Each attempt holds a thread: `concurrency` for proven sources, as many for probes, as many slow ones
        # (_launch), and one to move hedged copies into place.
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

    def _join(self, url: str, task: asyncio.Task[SignedManifest]) -> None:
        self.joining[url] = task
        task.add_done_callback(lambda _t: self.changed.set())

    @property
    def blame(self) -> list[dict[str, object]]:
        return self.outcomes.blame

    async def execute(self) -> FetchResult:
        body = self.manifest.body
        on_disk = sum(body.shards[i].size for i in self.partial.done)
        on_disk += sum(p.done_bytes for p in self.partial.progress.values())
        began = time.monotonic()
        try:
            await asyncio.to_thread(self.ctx.store.ensure_free_space, body.total_size - on_disk)
            if self.ctx.on_manifest is not None:
                self.ctx.on_manifest(self.manifest, on_disk)
            for index in list(self.partial.done):
                if self.ctx.on_shard is not None:
                    self.ctx.on_shard(index)
            logger.info(
                "fetching step %d: %d of %d shards missing, %d bytes on disk",
                self.manifest.step,
                len(self.queue),
                len(body.shards),
                on_disk,
            )
            await self._download_all()
            final = await self._finish()
        finally:
            # Stop transfer threads at their next chunk and wait for them before any file is closed.
            await self._stop_threads()
            await asyncio.to_thread(self.partial.close)
            await asyncio.to_thread(shutil.rmtree, self.hedge_dir, True)
        seconds = time.monotonic() - began
        resumed = self.resumed
        logger.info(
            "step %d verified and stored at %s (%.1f MiB in %.2f s, %d hedged shards)",
            self.manifest.step,
            final,
            (body.total_size - resumed) / 2**20,
            seconds,
            self.hedges,
        )
        return FetchResult(
            manifest=self.manifest,
            version_dir=final,
            fetched_bytes=body.total_size - resumed,
            resumed_bytes=resumed,
            received_bytes=self.received,
            hedges=self.hedges,
            hedges_won=self.hedges_won,
            seconds=seconds,
            sources=[s.report() for s in self.pool.sources.values()],
        )

    async def _download_all(self) -> None:
        saver = asyncio.create_task(self._journal(), name="weights-fetch-journal")
        peering = asyncio.create_task(self.peering.run(), name="weights-fetch-peering")
        peering.add_done_callback(self._peering_ended)
        try:
            await self._schedule()
        except BaseException:
            await self._stop_threads()
            # Verified shards stay for a rerun. A prefix is resumed only from its writer, so even a bad one
            # poisons no other source; those of sources caught sending wrong bytes are not kept at all.
            for index, progress in list(self.partial.progress.items()):
                writer = self.pool.sources.get(progress.writer or "")
                if writer is None or writer.shards_corrupt:
                    del self.partial.progress[index]
            await self._save_progress()
            raise
        finally:
            saver.cancel()
            peering.cancel()
            await asyncio.gather(saver, peering, return_exceptions=True)
            self.peering.close()

    def _peering_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()  # a bug of ours: the fetch stops with it rather than running blind
            self.changed.set()

    async def _stop_threads(self) -> None:
        self.cancelled.set()
        self.ctx.connections.abort()  # unblock reads now rather than after a stall timeout
        tasks = [a.task for attempts in self.inflight.values() for a in attempts if a.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.threads.shutdown, True)

    async def _finish(self) -> Path:
        body = self.manifest.body
        computed = [self.partial.done[i] for i in range(len(body.shards))]
        # The digests compared here are the ones computed from the received bytes, not the manifest's.
        await self._stop_threads()
        if (
            checkpoint_digest(computed) != body.checkpoint_sha256
        ):  # only reachable through a bug: never load it
            self.partial.close()
            await asyncio.to_thread(self.ctx.store.discard_partial, self.manifest.step)
            raise FetchError(
                f"assembled step {self.manifest.step} does not match checkpoint_sha256; discarded", self.blame
            )
        await asyncio.to_thread(
            shutil.rmtree, self.hedge_dir, True
        )  # never moved into place with the version
        final = await asyncio.to_thread(self.ctx.store.finalize, self.partial, durable=self.settings.durable)
        if self.settings.keep:
            await asyncio.to_thread(self.ctx.store.prune, self.settings.keep)
        return final

    async def _save_progress(self) -> None:
        await asyncio.to_thread(self.partial.write_progress, self.partial.progress_snapshot())

    async def _journal(self) -> None:
        while True:
            await asyncio.sleep(self.settings.save_interval_s)
            if self.dirty:
                self.dirty = False
                await self._save_progress()

    # ----- the scheduler ----------------------------------------------------------------------------------

    async def _schedule(self) -> None:
        while len(self.partial.done) < len(self.shards):
            self._admit_late_sources()
            wake = self._judge(time.monotonic())
            wake = min(wake, self._launch())
            if self.error is not None:
                raise self.error
            waiting_for = self.joining or (self.peering.absent and not self.pool.usable())
            if not (self.inflight or self.delayed or (self.queue and (self.pool.usable() or waiting_for))):
                index = self.queue.first() if self.queue else -1
                raise FetchError(
                    f"shard {index} of step {self.manifest.step} could not be fetched and verified: "
                    f"{self.outcomes.text(index) or 'no usable source'}",
                    self.blame,
                    shard=index,
                )
            self.changed.clear()
            try:  # wake on any attempt's end, or when one in flight can next be judged
                await asyncio.wait_for(self.changed.wait(), max(0.001, wake))
            except TimeoutError:
                pass
            if self.error is not None:
                raise self.error

    def _judge(self, now: float) -> float:
        """Mark the attempts that became slow; returns the seconds until one in flight can next be judged."""
        wake = MAX_IDLE_S
        for attempt in self._attempts():
            if attempt.slow:
                continue
            best = self.pool.best_bandwidth(attempt.source.url)
            if is_slow(attempt, best, now, self.settings):
                attempt.slow = True
                logger.info(
                    "shard %d: %s is slow (%.0f bytes/s after %.2f s); asking another source too",
                    attempt.index,
                    attempt.source.url,
                    attempt.watch.rate(now),
                    now - attempt.watch.started,
                )
                continue
            first = judge_at(attempt, best, self.settings)
            wake = min(wake, first - now if first > now else SCHEDULE_TICK_S)
        return wake

    def _attempts(self) -> list[Attempt]:
        return [a for attempts in self.inflight.values() for a in attempts]

    def _untried(self) -> set[str]:
        """Usable sources not asked for any shard yet in this fetch."""
        return {s.url for s in self.pool.usable()} - self.asked

    def _launch(self) -> float:
        """Start transfers while there is room; returns the seconds until a source cooling down may be asked.
        `concurrency` slots serve sources that have verified a shard in this fetch, and as many more serve
        probes: one shard at a time per source not proven yet. A source never asked in this fetch gets its
        first probe at once, without waiting for a probe slot (only the cap on transfers in flight bounds
        it): until some source is proven, a probe that holds its shard without sending it cannot be judged
        slow before `hedge_after_s`, so `concurrency` such sources drawn first would otherwise keep an honest
        one waiting that long. A slow transfer holds no slot; a source with one in flight gets nothing more."""
        limit = self.settings.concurrency
        while self.error is None:
            attempts = self._attempts()
            if len(attempts) >= 3 * limit:
                return MAX_IDLE_S
            proven = sum(1 for a in attempts if not a.slow and a.source.shards_ok)
            probing = sum(1 for a in attempts if not a.slow and not a.source.shards_ok)
            busy = {a.source.url for a in attempts if a.slow or not a.source.shards_ok}
            unproven = {s.url for s in self.pool.usable() if not s.shards_ok}
            full = unproven - self._untried() if probing >= limit else set()
            if proven >= limit:
                full = full | (set(self.pool.sources) - unproven)
            cooling = MAX_IDLE_S
            if self.queue:
                index, source, wait = self._next(busy | full)
                if source is not None:
                    self.queue.take(index)
                    self._start(index, source)
                    continue
                cooling = wait or MAX_IDLE_S
            if not self._hedge(busy | full, unproven):
                return cooling
        return MAX_IDLE_S

    def _next(self, taken: set[str]) -> tuple[int, SourceState | None, float]:
        """The rarest waiting shard a free source holds, and that source; else (shard, None, seconds to wait).
        When no source claims any of the shards looked at, the first one may go to any source (see the module
        docstring), after `availability_wait_s` if some source has not answered yet; when some source claims
        one but is busy or cooling down, the scheduler waits for it."""
        wait: float | None = None
        orphan: int | None = None
        claimed = False
        usable = self.pool.usable()
        now = self.pool.clock()
        # This runs at every wake-up of the scheduler: the sources that could take a shard now are found once,
        # and a shard is looked at closely only when one of them holds it.
        free = [s for s in usable if s.url not in taken and now >= s.cooldown_until]
        recordless = {s.url for s in usable if s.records is False}
        for n, index in enumerate(self.queue.candidates()):
            if n >= MAX_SCAN:
                break
            holders = [s for s in usable if s.holds(index)]
            if not holders:
                orphan = index if orphan is None else orphan
                continue
            claimed = True
            if not any(s.holds(index) for s in free):
                cooling = min(s.cooldown_until for s in holders) - now
                if cooling > 0:
                    wait = cooling if wait is None else min(wait, cooling)
                continue
            # Peers that hold the shard come before sources that sign no records (the origin, relays), so that
            # those serve what nobody else has yet.
            avoid = set(self.tried[index])
            if any(s.records for s in holders):
                avoid |= recordless
            lacking = {s.url for s in usable} - {s.url for s in holders}
            source, cooling = self.pool.pick(avoid=avoid, forbid=taken | lacking)
            if source is not None:
                return index, source, 0.0
            if cooling:
                wait = cooling if wait is None else min(wait, cooling)
        patience = self.started + self.settings.availability_wait_s - time.monotonic()
        if orphan is not None and not claimed and self.peering.unknown() and patience > 0:
            return orphan, None, min(patience, SCHEDULE_TICK_S)  # an answer may be a round trip away
        if orphan is not None and not claimed:
            # Asked blind, as before records existed: never an advertised peer, which gets only what it signed.
            peers = {s.url for s in usable if s.node_id is not None}
            source, cooling = self.pool.pick(avoid=self.tried[orphan], forbid=taken | peers)
            if source is not None:
                return orphan, source, 0.0
            wait = cooling or wait
        return orphan if orphan is not None else -1, None, wait or MAX_IDLE_S

    def _hedge(self, taken: set[str], unproven: set[str]) -> bool:
        """Ask another source for a shard whose every transfer is slow; False when there is none to ask.
        A source that has verified shards in this fetch is preferred: an untried one may be as slow.

        The end game: once no shard is left to start, a proven source's free slot also takes a shard whose
        every transfer is from a source not proven in this fetch, without waiting until that transfer can be
        judged slow. Otherwise the honest sources finish everything else and then sit idle while the last
        shards wait on sources that may never deliver (on a fast link, for longer than the whole fetch took).
        It costs at most one extra copy of each shard in flight at the end, the loser cut at once."""
        end_game = not self.queue
        for index, attempts in self.inflight.items():
            if len(attempts) >= MAX_COPIES or index in self.winners:
                continue
            waiting = all(a.slow for a in attempts)
            if not waiting and not (end_game and all(not a.source.shards_ok for a in attempts)):
                continue
            forbid = taken | {a.source.url for a in attempts} | self.peering.lacking(index)
            source, _ = self.pool.pick(avoid=self.tried[index], forbid=forbid | unproven)
            if source is None and waiting:  # the end game never gives a shard to another unproven source
                source, _ = self.pool.pick(avoid=self.tried[index], forbid=forbid)
            if source is not None:
                self.hedges += 1
                self._start(index, source)
                return True
        return False

    def _start(self, index: int, source: SourceState, recheck: Recheck | None = None) -> None:
        s = self.settings
        in_place = not any(a.in_place for a in self.inflight.get(index, []))
        size = self.shards[index].size
        start, side, progress = 0, None, None
        if in_place:
            held = self.partial.progress.get(index)
            start = 0 if recheck is not None else resume_point(held, source.url)
            if start and held is not None:
                progress = held
            else:  # another source's prefix (or a failed resume's) is overwritten from byte 0
                progress = self.partial.progress[index] = ShardProgress(0, source.url)
        else:
            self.hedge_dir.mkdir(exist_ok=True)
            self._serial += 1
            side = self.hedge_dir / f"{index}.{self._serial}"
        head_s = s.connect_timeout_s + s.stall_timeout_s
        watch = Watch(
            deadline_s=head_s + s.rate_window_s + (size - start) / s.min_rate_bytes_s,
            head_s=head_s,
            min_rate=s.min_rate_bytes_s,
            window_s=s.rate_window_s,
        )
        attempt = Attempt(index, source, size, start, watch, side, progress, recheck)
        self.tried[index].add(source.url)
        self.asked.add(source.url)
        self.inflight.setdefault(index, []).append(attempt)
        attempt.task = asyncio.create_task(self._run(attempt), name=f"weights-shard-{index}")

    def _admit_late_sources(self) -> None:
        for url, task in list(self.joining.items()):
            if not task.done():
                continue
            del self.joining[url]
            if task.cancelled():
                continue
            error = task.exception()
            if error is not None and not isinstance(error, ManifestError):
                raise error  # not the source's doing: a bug of ours
            if isinstance(error, ManifestAbsent):
                self.peering.absent_again(url)  # still without the version: asked again later
                continue
            if error is None and task.result().digest == self.manifest.digest:
                self.pool.include(url)
                logger.info("source %s joined the fetch of step %d", url, self.manifest.step)
            else:  # a lagging source keeps the reason it was set aside for; a silent one gets its own
                why = str(error) if error else f"serves another manifest than {self.manifest.digest[:16]}…"
                if error is not None:
                    logger.warning("source %s: %s", url, why)
                before = self.pool.sources[url].excluded or ""
                self.pool.exclude(url, f"{before} ({why})" if before.startswith("serves step") else why)

    # ----- one attempt ------------------------------------------------------------------------------------

    async def _run(self, attempt: Attempt) -> None:
        recheck: Recheck | None = None
        try:
            result = await self.loop.run_in_executor(self.threads, self._transfer, attempt)
            await self._won(attempt, result)
        except TransferCancelled:
            if attempt.index in self.winners:  # lost the race to a faster copy: that is its measured rate
                self.pool.record_slow(attempt.source, attempt.watch.rate(time.monotonic()))
        except SourceError as failure:
            recheck = self._failed(attempt, failure)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # our own failure (the disk, a bug): the fetch stops with it
            if self.error is None:
                self.error = exc
        finally:
            attempts = self.inflight.get(attempt.index, [])
            if attempt in attempts:
                attempts.remove(attempt)
            if not attempts:
                self.inflight.pop(attempt.index, None)
            if attempt.side_path is not None:
                attempt.side_path.unlink(missing_ok=True)
            self.changed.set()
        if recheck is not None:
            self._recheck(attempt, recheck)

    def _transfer(self, attempt: Attempt) -> ShardResult:
        """On a worker thread: the transfer itself, into place or into the attempt's side file."""
        index, entry = attempt.index, self.shards[attempt.index]
        common: dict[str, Any] = dict(
            size=entry.size,
            sha256=entry.sha256,
            start=attempt.start,
            watch=attempt.watch,
            cancelled=self.cancelled,
            chunk_bytes=self.settings.chunk_bytes,
        )
        path = shard_path(self.manifest.step, index)
        progress = attempt.progress
        if progress is not None:
            hasher = rehash(self.partial, index, attempt.start) if attempt.start else fresh_hasher()

            def on_chunk(offset: int, n: int) -> None:
                progress.done_bytes = offset  # only after the bytes are written: the journal never runs ahead
                self.loop.call_soon_threadsafe(self._count, attempt, n)

            return download_shard(
                self.ctx.connections,
                attempt.source.url,
                path,
                hasher=hasher,
                sink=lambda offset, data: self.partial.write(index, offset, data),
                on_chunk=on_chunk,
                **common,
            )
        assert attempt.side_path is not None
        fd, sink = side_writer(attempt.side_path)

        def count(_offset: int, n: int) -> None:
            self.loop.call_soon_threadsafe(self._count, attempt, n)

        try:
            return download_shard(
                self.ctx.connections,
                attempt.source.url,
                path,
                hasher=fresh_hasher(),
                sink=sink,
                on_chunk=count,
                **common,
            )
        finally:
            os.close(fd)  # by the thread that wrote it, after its last write

    async def _won(self, attempt: Attempt, result: ShardResult) -> None:
        index = attempt.index
        if index in self.winners:  # the other copy verified first
            raise TransferCancelled()
        self.winners.add(index)  # before any await: a second copy finishing meanwhile is the loser
        others = [a for a in self.inflight.get(index, []) if a is not attempt]
        for other in others:
            self.ctx.connections.watchdog.cut(
                other.watch, "a faster copy of the shard verified first", cancelled=True
            )
        if not attempt.in_place:
            # The in-place transfer must have stopped writing before the verified copy is moved over it.
            await asyncio.gather(
                *(o.task for o in others if o.in_place and o.task is not None), return_exceptions=True
            )
            await self.loop.run_in_executor(self.threads, install_side, self.partial, attempt)
            self.hedges_won += 1
        self.outcomes.verified(attempt, result)
        self.resumed += attempt.start if attempt.in_place else 0
        self.partial.done[index] = result.digest
        self.partial.progress.pop(index, None)
        rest = self.shards[index].size - self.reported.get(index, 0)
        self.reported[index] = self.shards[index].size
        if rest > 0 and self.ctx.on_bytes is not None:
            self.ctx.on_bytes(rest)
        self.dirty = True
        if self.ctx.on_shard is not None:
            self.ctx.on_shard(index)

    def _count(self, attempt: Attempt, n: int) -> None:
        """On the event loop, per chunk written: bytes received, and progress of the in-place copy (once)."""
        self.received += n
        if not attempt.in_place or attempt.index in self.winners or attempt.watch.cancelled:
            return
        size = self.shards[attempt.index].size
        add = min(n, size - self.reported.get(attempt.index, 0))
        if add > 0:
            self.reported[attempt.index] = self.reported.get(attempt.index, 0) + add
            self.dirty = True
            if self.ctx.on_bytes is not None:
                self.ctx.on_bytes(add)

    def _failed(self, attempt: Attempt, failure: SourceError) -> Recheck | None:
        """Charge a failed attempt and queue its shard again; returns a Recheck when nobody may be charged yet."""
        index = attempt.index
        others = [a for a in self.inflight.get(index, []) if a is not attempt]
        claimed = attempt.source.have
        busy = isinstance(failure, ShardFailure) and failure.busy
        # 404 or a plain 503 ("not verified here") deny holding the shard; a busy 503 says it is held but every
        # upload slot is taken, which is no lie.
        refused = failure.status == 404 or (failure.status == 503 and not busy)
        if claimed is not None and index in claimed and refused:
            # It signed that it holds the shard: not serving it is a lie, charged and demoted for good.
            self.outcomes.lied(attempt, failure.reason)
            self.queue.claims_changed(claimed, claimed - {index})
            attempt.source.have = claimed - {index}
            if not others and index not in self.winners:
                self._requeue(index, 0.0)
            return None
        if failure.retry_after is not None and self.outcomes.not_ready(
            attempt, failure.reason, failure.retry_after if busy else 0.0
        ):
            # A relay still mirroring this shard, or a server with no free upload slot: no penalty and no
            # attempt used; other holders are tried at once, and when every holder was, it waits Retry-After.
            if not others and index not in self.winners:
                holders = {u.url for u in self.pool.usable()} - self.peering.lacking(index)
                everyone = (holders or {u.url for u in self.pool.usable()}) <= self.tried[index]
                self._requeue(index, failure.retry_after if everyone else 0.0, first=False)
            return None
        if attempt.in_place and (failure.corrupt or attempt.recheck is not None):
            self.partial.progress.pop(index, None)  # wrong bytes, or bytes no verified copy vouches for
            self.dirty = True
        recheck = self.outcomes.failed(attempt, failure)
        if recheck is not None or others or index in self.winners:
            return recheck  # the recheck, or the other copy, carries on
        if self.outcomes.exhausted(index, {u.url for u in self.pool.usable()} <= self.tried[index]):
            self.error = FetchError(
                f"shard {index} of step {self.manifest.step} could not be fetched and verified: "
                f"{self.outcomes.text(index)}",
                self.blame,
                shard=index,
            )
            return None
        self._requeue(index, 0.0)
        return None

    def _recheck(self, attempt: Attempt, recheck: Recheck) -> None:
        """Ask the same source for the whole shard, once its resumed copy's attempt is gone."""
        if self.error is not None or self.cancelled.is_set():
            return
        if self.inflight.get(attempt.index) or attempt.index in self.winners:
            self.outcomes.settle_recheck(attempt, recheck)  # another copy decides the shard
            return
        self._start(attempt.index, attempt.source, recheck)

    def _requeue(self, index: int, delay: float, *, first: bool = True) -> None:
        if delay <= 0:
            self.queue.put_back(index, first=first)
            return
        self.delayed += 1

        def back() -> None:
            self.delayed -= 1
            self.queue.put_back(index, first=first)
            self.changed.set()

        self.loop.call_later(delay, back)
