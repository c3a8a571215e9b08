"""The shard phase of a fetch: workers that draw sources, journal progress, and the final verification.

Each worker task takes the next missing shard, draws a source (sources.py) and runs the transfer on a
thread of this run's pool (transfer.py). Every exit path, success or not, stops the transfer threads at a
chunk boundary and waits for them before the partial version's files are closed, so no thread ever
writes to a closed (or reused) file descriptor.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import FetchError
from .manifest import SignedManifest, checkpoint_digest
from .sources import SourcePool
from .store import CHECKPOINT_NAME, PartialVersion, ShardProgress
from .transfer import ShardFailure, TransferCancelled, download_shard

if TYPE_CHECKING:
    from .fetch import Fetcher

logger = logging.getLogger(__name__)


@dataclass
class FetchResult:
    """Where a fetched (or already held) version lies, and how the fetch went."""

    manifest: SignedManifest
    version_dir: Path
    fetched_bytes: int = 0
    resumed_bytes: int = 0
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
            "seconds": round(self.seconds, 3),
            "already_held": self.already_held,
            "sources": self.sources,
        }


class ShardRun:
    """Downloads the missing shards of one partial version and moves it into place when all verified."""

    def __init__(self, fetcher: Fetcher, partial: PartialVersion, pool: SourcePool) -> None:
        self.f = fetcher
        self.settings = fetcher.settings
        self.partial = partial
        self.manifest = partial.manifest
        self.pool = pool
        self.queue = collections.deque(i for i in range(len(self.manifest.body.shards)) if i not in partial.done)
        self.blame: list[dict[str, object]] = []
        self.fetched = 0
        self.dirty = False
        self.cancelled = threading.Event()
        self.threads = ThreadPoolExecutor(max_workers=self.settings.concurrency, thread_name_prefix="weights-shard")
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
            logger.info("fetching step %d: %d of %d shards missing, %d bytes resumed", self.manifest.step,
                        len(self.queue), len(body.shards), on_disk)
            await self._download_all()
            final = await self._finish()
        finally:
            # Stop transfer threads at their next chunk and wait for them before any file is closed.
            await self._stop_threads()
            await asyncio.to_thread(self.partial.close)
        seconds = time.monotonic() - began
        logger.info("step %d verified and stored at %s (%.1f MiB in %.2f s)", self.manifest.step, final,
                    self.fetched / 2**20, seconds)
        return FetchResult(manifest=self.manifest, version_dir=final, fetched_bytes=self.fetched,
                           resumed_bytes=on_disk, seconds=seconds, sources=[s.report() for s in self.pool.sources.values()])

    async def _download_all(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                saver = group.create_task(self._journal(), name="weights-fetch-journal")
                workers = [group.create_task(self._worker(), name=f"weights-fetch-worker-{n}")
                           for n in range(min(self.settings.concurrency, len(self.queue)))]
                await asyncio.gather(*workers)
                saver.cancel()
        except BaseExceptionGroup as group_error:
            failures = [e for e in group_error.exceptions if isinstance(e, FetchError)]
            if not failures:
                raise
            await self._stop_threads()
            if any(b.get("corrupt") and b["shard"] == failures[0].shard for b in self.blame):
                # No source delivered this shard intact and at least one sent wrong bytes: the version cannot
                # be verified from these sources. It is discarded, never loaded.
                self.partial.close()
                await asyncio.to_thread(self.f.store.discard_partial, self.manifest.step)
            else:
                await self._save_progress()
            raise failures[0] from None
        except BaseException:
            await self._stop_threads()
            await self._save_progress()
            raise

    async def _stop_threads(self) -> None:
        self.cancelled.set()
        self.f.connections.abort()  # unblock reads now rather than after a stall timeout
        await asyncio.to_thread(self.threads.shutdown, True)

    async def _finish(self) -> Path:
        body = self.manifest.body
        computed = [self.partial.done[i] for i in range(len(body.shards))]
        # The digests compared here are the ones computed from the received bytes, not the manifest's.
        await self._stop_threads()
        if checkpoint_digest(computed) != body.checkpoint_sha256:  # only reachable through a bug: never load it
            self.partial.close()
            await asyncio.to_thread(self.f.store.discard_partial, self.manifest.step)
            raise FetchError(f"assembled step {self.manifest.step} does not match checkpoint_sha256; discarded", self.blame)
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

    def _count(self, n: int) -> None:  # on the event loop
        self.fetched += n
        self.dirty = True
        if self.f.on_bytes is not None:
            self.f.on_bytes(n)

    def _count_from_thread(self, n: int) -> None:
        self.loop.call_soon_threadsafe(self._count, n)

    async def _worker(self) -> None:
        while self.queue:
            await self._fetch_one(self.queue.popleft())

    async def _fetch_one(self, index: int) -> None:
        settings = self.settings
        progress = self.partial.progress.setdefault(index, ShardProgress())
        tried: set[str] = set()
        attempts = not_ready = 0
        while attempts < settings.max_attempts_per_shard:
            source, wait = self.pool.pick(avoid=tried)
            if source is None:
                if not self.pool.usable():
                    break
                await asyncio.sleep(min(wait, settings.stall_timeout_s))
                continue
            attempts += 1
            resumed = progress.done_bytes > 0
            progress.sources.add(source.url)
            try:
                result = await self.loop.run_in_executor(
                    self.threads, lambda: download_shard(
                        self.f.connections, source.url, self.partial, index, progress,
                        chunk_bytes=settings.chunk_bytes, cancelled=self.cancelled, on_bytes=self._count_from_thread))
            except TransferCancelled:
                raise asyncio.CancelledError() from None
            except ShardFailure as failure:
                if failure.retry_after is not None and not_ready < settings.max_not_ready:
                    # A relay still mirroring this shard: no penalty and no attempt used; prefer others meanwhile.
                    attempts, not_ready = attempts - 1, not_ready + 1
                    tried.add(source.url)
                    await asyncio.sleep(failure.retry_after if len(tried) >= len(self.pool.usable()) else 0)
                    continue
                # Bytes resumed from another source or run cannot be pinned on this one: no corrupt penalty.
                self.pool.record_failure(source, failure.reason, corrupt=failure.corrupt and not resumed)
                self.blame.append({"shard": index, "source": source.url, "reason": failure.reason, "corrupt": failure.corrupt})
                logger.warning("source %s: %s", source.url, failure.reason)
                tried.add(source.url)
                if failure.corrupt:
                    progress.done_bytes, progress.sources = 0, set()
                continue
            self.pool.record_success(source, result.received, result.seconds)
            self.partial.done[index] = result.digest
            self.partial.progress.pop(index, None)
            self.dirty = True
            if self.f.on_shard is not None:
                self.f.on_shard(index)
            return
        tried_text = "; ".join(f"{b['source']}: {b['reason']}" for b in self.blame if b["shard"] == index)
        raise FetchError(f"shard {index} of step {self.manifest.step} could not be fetched and verified: "
                         f"{tried_text or 'no usable source'}", self.blame, shard=index)
