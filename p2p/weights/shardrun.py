"""The shard phase of a fetch: a scheduler that spreads shards over sources, hedges slow ones, and verifies.

One loop on the event loop starts attempts (attempts.py) while there is a free slot: `concurrency` slots for
sources that have verified a shard in this fetch, as many for probes (one shard at a time per source not
proven yet). The next missing shard goes to a source drawn by weight (sources.py); a source with a slow
attempt in flight gets no more. An attempt judged slow gives up its slot, and its shard is also asked of
another source (a hedge): the first copy that verifies wins, and the other is cut at its next chunk boundary
and charged its measured rate.
Each attempt's failure is charged to its source alone and the shard goes back to the queue; the fetch fails
only when every usable source has failed a shard at least once and `max_attempts_per_shard` failures are
reached. Sources whose manifest arrives after the fetch started join when it is the manifest being fetched.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .attempts import Attempt, fresh_hasher, install_side, is_slow, side_writer
from .errors import FetchError, ManifestError, SourceError
from .manifest import SignedManifest, checkpoint_digest
from .sources import SourcePool, SourceState
from .store import CHECKPOINT_NAME, PartialVersion, ShardProgress
from .transfer import ShardResult, TransferCancelled, download_shard, rehash, shard_path
from .watchdog import Watch

if TYPE_CHECKING:
    from .fetch import Fetcher

logger = logging.getLogger(__name__)

SCHEDULE_TICK_S = 0.02  # how often transfers in flight are judged (and new ones started) when nothing ends
MAX_COPIES = 3  # transfers of one shard at once: the first, and up to two hedges when each before is slow
HEDGE_DIR = ".hedges"  # side files of hedged copies, inside the partial version; removed before it is moved


@dataclass
class FetchResult:
    """Where a fetched (or already held) version lies, and how the fetch went."""

    manifest: SignedManifest
    version_dir: Path
    fetched_bytes: int = 0  # shard bytes this fetch added to the version (total - resumed on success)
    resumed_bytes: int = 0
    received_bytes: int = (
        0  # every body byte received, including discarded copies (hedges lost, corrupt shards)
    )
    hedges: int = 0  # shards also asked of a second source because the first was slow
    hedges_won: int = 0  # ... and that second copy verified first
    seconds: float = 0.0
    already_held: bool = False
    sources: list[dict[str, object]] = field(default_factory=list)

    @property
    def checkpoint_dir(self) -> Path:
        return self.version_dir / CHECKPOINT_NAME

    def report(self) -> dict[str, object]:
        return {
            "step": self.manifest.step,
            "run_id": self.manifest.body.run_id,
            "manifest_sha256": self.manifest.digest,
            "checkpoint_sha256": self.manifest.body.checkpoint_sha256,
            "checkpoint_dir": str(self.checkpoint_dir),
            "total_bytes": self.manifest.body.total_size,
            "fetched_bytes": self.fetched_bytes,
            "resumed_bytes": self.resumed_bytes,
            "received_bytes": self.received_bytes,
            "hedges": self.hedges,
            "hedges_won": self.hedges_won,
            "seconds": round(self.seconds, 3),
            "already_held": self.already_held,
            "sources": self.sources,
        }


class ShardRun:
    """Downloads the missing shards of one partial version and moves it into place when all verified."""

    def __init__(
        self,
        fetcher: Fetcher,
        partial: PartialVersion,
        pool: SourcePool,
        joining: dict[str, asyncio.Task[SignedManifest]] | None = None,
    ) -> None:
        self.f = fetcher
        self.settings = fetcher.settings
        self.partial = partial
        self.manifest = partial.manifest
        self.shards = self.manifest.body.shards
        self.pool = pool
        self.joining = dict(joining or {})  # manifest requests still running: their sources may join
        self.queue = collections.deque(i for i in range(len(self.shards)) if i not in partial.done)
        self.inflight: dict[int, list[Attempt]] = {}
        self.tried: dict[int, set[str]] = collections.defaultdict(set)
        self.failures: collections.Counter[int] = collections.Counter()
        self.not_ready: collections.Counter[int] = collections.Counter()
        self.winners: set[int] = set()  # shards whose first verified copy is being (or has been) kept
        self.reported = {i: p.done_bytes for i, p in partial.progress.items()}  # bytes passed to on_bytes
        self.delayed = 0  # shards waiting out a relay's Retry-After before they are queued again
        self.blame: list[dict[str, object]] = []
        self.received = self.hedges = self.hedges_won = self._serial = 0
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

    async def execute(self) -> FetchResult:
        body = self.manifest.body
        on_disk = sum(body.shards[i].size for i in self.partial.done)
        on_disk += sum(p.done_bytes for p in self.partial.progress.values())
        began = time.monotonic()
        try:
            await asyncio.to_thread(self.f.store.ensure_free_space, body.total_size - on_disk)
            if self.f.on_manifest is not None:
                self.f.on_manifest(self.manifest, on_disk)
            for index in list(self.partial.done):
                if self.f.on_shard is not None:
                    self.f.on_shard(index)
            logger.info(
                "fetching step %d: %d of %d shards missing, %d bytes resumed",
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
        logger.info(
            "step %d verified and stored at %s (%.1f MiB in %.2f s, %d hedged shards)",
            self.manifest.step,
            final,
            (body.total_size - on_disk) / 2**20,
            seconds,
            self.hedges,
        )
        return FetchResult(
            manifest=self.manifest,
            version_dir=final,
            fetched_bytes=body.total_size - on_disk,
            resumed_bytes=on_disk,
            received_bytes=self.received,
            hedges=self.hedges,
            hedges_won=self.hedges_won,
            seconds=seconds,
            sources=[s.report() for s in self.pool.sources.values()],
        )

    async def _download_all(self) -> None:
        saver = asyncio.create_task(self._journal(), name="weights-fetch-journal")
        try:
            await self._schedule()
        except FetchError as failure:
            await self._stop_threads()
            if any(b.get("corrupt") and b["shard"] == failure.shard for b in self.blame):
                # No source delivered this shard intact and at least one sent wrong bytes: the version cannot
                # be verified from these sources. It is discarded, never loaded.
                self.partial.close()
                await asyncio.to_thread(self.f.store.discard_partial, self.manifest.step)
            else:
                await self._save_progress()
            raise
        except BaseException:
            await self._stop_threads()
            await self._save_progress()
            raise
        finally:
            saver.cancel()
            await asyncio.gather(saver, return_exceptions=True)

    async def _stop_threads(self) -> None:
        self.cancelled.set()
        self.f.connections.abort()  # unblock reads now rather than after a stall timeout
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
            await asyncio.to_thread(self.f.store.discard_partial, self.manifest.step)
            raise FetchError(
                f"assembled step {self.manifest.step} does not match checkpoint_sha256; discarded", self.blame
            )
        await asyncio.to_thread(
            shutil.rmtree, self.hedge_dir, True
        )  # never moved into place with the version
        final = await asyncio.to_thread(self.f.store.finalize, self.partial, durable=self.settings.durable)
        if self.settings.keep:
            await asyncio.to_thread(self.f.store.prune, self.settings.keep)
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
            now = time.monotonic()
            for attempt in self._attempts():
                best = self.pool.best_bandwidth(attempt.source.url)
                if not attempt.slow and is_slow(attempt, best, now, self.settings):
                    attempt.slow = True
                    logger.info(
                        "shard %d: %s is slow (%.0f bytes/s after %.1f s); asking another source too",
                        attempt.index,
                        attempt.source.url,
                        attempt.watch.rate(now),
                        now - attempt.watch.started,
                    )
            self._launch()
            if self.error is not None:
                raise self.error
            if not (self.inflight or self.delayed or (self.queue and (self.pool.usable() or self.joining))):
                index = self.queue[0] if self.queue else -1
                raise FetchError(
                    f"shard {index} of step {self.manifest.step} could not be fetched and verified: "
                    f"{self._blame_text(index) or 'no usable source'}",
                    self.blame,
                    shard=index,
                )
            self.changed.clear()
            try:  # wake on any attempt's end, else every tick to judge the ones in flight
                await asyncio.wait_for(self.changed.wait(), SCHEDULE_TICK_S)
            except TimeoutError:
                pass
            if self.error is not None:
                raise self.error

    def _attempts(self) -> list[Attempt]:
        return [a for attempts in self.inflight.values() for a in attempts]

    def _launch(self) -> None:
        """Start transfers while there is room. `concurrency` slots serve sources that have verified a shard in
        this fetch, and as many more serve probes, one at a time per untried source: sources that hold probes
        without sending anything cannot crowd out an honest source that has not been drawn yet. A slow
        transfer holds no slot; a source with one in flight gets nothing more."""
        limit = self.settings.concurrency
        while self.error is None:
            attempts = self._attempts()
            if len(attempts) >= 3 * limit:
                return
            proven = sum(1 for a in attempts if not a.slow and a.source.shards_ok)
            probing = sum(1 for a in attempts if not a.slow and not a.source.shards_ok)
            busy = {a.source.url for a in attempts if a.slow or not a.source.shards_ok}
            unproven = {s.url for s in self.pool.usable() if not s.shards_ok}
            full = unproven if probing >= limit else set()
            if proven >= limit:
                full = full | (set(self.pool.sources) - unproven)
            if self.queue:
                index = self.queue[0]
                source, _ = self.pool.pick(avoid=self.tried[index], forbid=busy | full)
                if source is not None:
                    self.queue.popleft()
                    self._start(index, source)
                    continue
            if not self._hedge(busy | full, unproven):
                return

    def _hedge(self, taken: set[str], unproven: set[str]) -> bool:
        """Ask another source for a shard whose every transfer is slow; False when there is none to ask.
        A source that has verified shards in this fetch is preferred: an untried one may be as slow."""
        for index, attempts in self.inflight.items():
            if len(attempts) >= MAX_COPIES or not all(a.slow for a in attempts) or index in self.winners:
                continue
            forbid = taken | {a.source.url for a in attempts}
            source, _ = self.pool.pick(avoid=self.tried[index], forbid=forbid | unproven)
            if source is None:
                source, _ = self.pool.pick(avoid=self.tried[index], forbid=forbid)
            if source is not None:
                self.hedges += 1
                self._start(index, source)
                return True
        return False

    def _start(self, index: int, source: SourceState) -> None:
        s = self.settings
        in_place = not any(a.in_place for a in self.inflight.get(index, []))
        size = self.shards[index].size
        progress = self.partial.progress.setdefault(index, ShardProgress()) if in_place else None
        start = progress.done_bytes if progress is not None else 0
        side = None
        if not in_place:
            self.hedge_dir.mkdir(exist_ok=True)
            self._serial += 1
            side = self.hedge_dir / f"{index}.{self._serial}"
        elif progress is not None:
            progress.sources.add(source.url)
        head_s = s.connect_timeout_s + s.stall_timeout_s
        watch = Watch(
            deadline_s=head_s + s.rate_window_s + (size - start) / s.min_rate_bytes_s,
            head_s=head_s,
            min_rate=s.min_rate_bytes_s,
            window_s=s.rate_window_s,
        )
        attempt = Attempt(index, source, size, start, watch, side)
        self.tried[index].add(source.url)
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
            if error is None and task.result().digest == self.manifest.digest:
                self.pool.include(url)
                logger.info("source %s joined the fetch of step %d", url, self.manifest.step)
            else:  # a lagging source keeps the reason it was set aside for; a silent one gets its own
                why = str(error) if error else f"serves another manifest than {self.manifest.digest[:16]}…"
                before = self.pool.sources[url].excluded or ""
                self.pool.exclude(url, f"{before} ({why})" if before.startswith("serves step") else why)

    # ----- one attempt ------------------------------------------------------------------------------------

    async def _run(self, attempt: Attempt) -> None:
        try:
            result = await self.loop.run_in_executor(self.threads, self._transfer, attempt)
            await self._won(attempt, result)
        except TransferCancelled:
            if attempt.index in self.winners:  # lost the race to a faster copy: that is its measured rate
                self.pool.record_slow(attempt.source, attempt.watch.rate(time.monotonic()))
        except SourceError as failure:
            self._failed(attempt, failure)
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
        if attempt.in_place:
            progress = self.partial.progress[index]
            hasher = rehash(self.partial, index, attempt.start) if attempt.start else fresh_hasher()

            def on_chunk(offset: int, n: int) -> None:
                progress.done_bytes = offset  # only after the bytes are written: the journal never runs ahead
                self.loop.call_soon_threadsafe(self._count, attempt, n)

            return download_shard(
                self.f.connections,
                attempt.source.url,
                path,
                hasher=hasher,
                sink=lambda offset, data: self.partial.write(index, offset, data),
                on_chunk=on_chunk,
                **common,
            )
        assert attempt.side_path is not None
        fd, sink = side_writer(attempt.side_path)
        try:
            return download_shard(
                self.f.connections,
                attempt.source.url,
                path,
                hasher=fresh_hasher(),
                sink=sink,
                on_chunk=lambda _o, n: self.loop.call_soon_threadsafe(self._count, attempt, n),
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
            self.f.connections.watchdog.cut(
                other.watch, "a faster copy of the shard verified first", cancelled=True
            )
        if not attempt.in_place:
            # The in-place transfer must have stopped writing before the verified copy is moved over it.
            await asyncio.gather(
                *(o.task for o in others if o.in_place and o.task is not None), return_exceptions=True
            )
            await self.loop.run_in_executor(self.threads, install_side, self.partial, attempt)
            self.hedges_won += 1
        self.pool.record_success(attempt.source, result.received, result.seconds)
        self.partial.done[index] = result.digest
        self.partial.progress.pop(index, None)
        rest = self.shards[index].size - self.reported.get(index, 0)
        self.reported[index] = self.shards[index].size
        if rest > 0 and self.f.on_bytes is not None:
            self.f.on_bytes(rest)
        self.dirty = True
        if self.f.on_shard is not None:
            self.f.on_shard(index)

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
            if self.f.on_bytes is not None:
                self.f.on_bytes(add)

    def _failed(self, attempt: Attempt, failure: SourceError) -> None:
        s, index, source = self.settings, attempt.index, attempt.source
        reason = f"shard {index}: {failure.reason}"
        others = [a for a in self.inflight.get(index, []) if a is not attempt]
        if failure.retry_after is not None and self.not_ready[index] < s.max_not_ready:
            # A relay still mirroring this shard: no penalty and no attempt used; others are preferred meanwhile.
            self.not_ready[index] += 1
            self.pool.record_not_ready(source)
            if not others and index not in self.winners:
                everyone = {u.url for u in self.pool.usable()} <= self.tried[index]
                self._requeue(index, failure.retry_after if everyone else 0.0)
            return
        # A digest over bytes resumed from other transfers cannot be pinned on this source: no corrupt penalty.
        resumed = attempt.in_place and attempt.start > 0
        self.pool.record_failure(source, reason, corrupt=failure.corrupt and not resumed)
        self.blame.append(
            {"shard": index, "source": source.url, "reason": failure.reason, "corrupt": failure.corrupt}
        )
        logger.warning("source %s: %s", source.url, reason)
        self.failures[index] += 1
        if failure.corrupt and attempt.in_place:
            self.partial.progress[index] = ShardProgress()  # refetched from its first byte
        if others or index in self.winners:
            return  # the other copy carries on
        usable = {u.url for u in self.pool.usable()}
        if self.failures[index] >= s.max_attempts_per_shard and usable <= self.tried[index]:
            self.error = FetchError(
                f"shard {index} of step {self.manifest.step} could not be fetched and verified: "
                f"{self._blame_text(index)}",
                self.blame,
                shard=index,
            )
            return
        self._requeue(index, 0.0)

    def _requeue(self, index: int, delay: float) -> None:
        if delay <= 0:
            self.queue.appendleft(index)
            return
        self.delayed += 1

        def back() -> None:
            self.delayed -= 1
            self.queue.appendleft(index)
            self.changed.set()

        self.loop.call_later(delay, back)

    def _blame_text(self, index: int) -> str:
        return "; ".join(f"{b['source']}: {b['reason']}" for b in self.blame if b["shard"] == index)
