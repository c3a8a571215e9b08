"""The shard phase of a fetch: download every missing shard of one partial version, verify, move into place.

A shard run is made of small parts that share one state (run_state.py): a scheduler that hands the rarest
waiting shard to a source that holds it and hedges slow transfers (scheduler.py), the attempts it starts and
settles (attempt_runner.py), a task that keeps each source's signed availability record (peering.py), and the
credits and charges of each attempt (outcomes.py). This module starts and stops them: it journals progress
while they run, and on every exit path, success or not, cuts the transfers in flight and waits for their
threads before the partial version's files are closed, so no thread ever writes to a closed (or reused) file
descriptor.

A run may be given the shards it is to hold (a selection, selection.py): only those are asked for, and once
they all verified the version stays where it is, under the store's .partial/, its journal saying what it holds
(the files are sparse: nothing else is written). A run wanting every shard moves the version into place.

The fetch fails only when every usable source that could still serve a shard (it signs no records, or claims
the shard) has failed it `max_attempts_per_shard` times: budgets are per source (outcomes.py). Verified shards
are kept even then: they match the signed manifest whoever sent them, and a rerun fetches only what is missing.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from .attempt_runner import AttemptRunner
from .errors import FetchError
from .manifest import SignedManifest, checkpoint_digest
from .result import FetchResult
from .run_state import FetchContext, RunState
from .scheduler import Scheduler
from .sources import SourcePool
from .store import PartialVersion

logger = logging.getLogger(__name__)

__all__ = ["FetchContext", "ShardRun"]


class ShardRun:
    """Downloads the missing shards of one partial version and moves it into place when all verified."""

    def __init__(
        self,
        context: FetchContext,
        partial: PartialVersion,
        pool: SourcePool,
        joining: dict[str, asyncio.Task[SignedManifest]] | None = None,
        absent: set[str] | None = None,
        wanted: frozenset[int] | None = None,
    ) -> None:
        self.state = RunState(context, partial, pool, joining, absent, wanted)
        self.scheduler = Scheduler(self.state, AttemptRunner(self.state))
        self.ctx = context
        self.settings = context.settings
        self.partial = partial
        self.manifest = partial.manifest
        self.pool = pool
        self.queue = self.state.queue
        self.peering = self.state.peering
        self.cancelled = self.state.cancelled
        self.threads = self.state.threads
        self.hedge_dir = self.state.hedge_dir
        self.outcomes = self.state.outcomes
        self.changed = self.state.changed

    @property
    def blame(self) -> list[dict[str, object]]:
        return self.outcomes.blame

    async def execute(self) -> FetchResult:
        body = self.manifest.body
        wanted = self.state.wanted
        whole = len(wanted) == len(body.shards)
        selected = sum(body.shards[i].size for i in wanted)
        on_disk = sum(body.shards[i].size for i in self.partial.done if i in wanted)
        on_disk += sum(p.done_bytes for i, p in self.partial.progress.items() if i in wanted)
        began = time.monotonic()
        try:
            await asyncio.to_thread(self.ctx.store.ensure_free_space, selected - on_disk)
            if self.ctx.on_manifest is not None:
                self.ctx.on_manifest(self.manifest, on_disk)
            for index in list(self.partial.done):
                if self.ctx.on_shard is not None:
                    self.ctx.on_shard(index)
            logger.info(
                "fetching step %d: %d of %d %sshards missing, %d bytes on disk",
                self.manifest.step,
                len(self.queue),
                len(wanted),
                "" if whole else f"selected (of {len(body.shards)}) ",
                on_disk,
            )
            await self._download_all()
            final = await (self._finish() if whole else self._finish_part())
        finally:
            # Stop transfer threads at their next chunk and wait for them before any file is closed.
            await self._stop_threads()
            await asyncio.to_thread(self.partial.close)
            await asyncio.to_thread(shutil.rmtree, self.hedge_dir, True)
        seconds = time.monotonic() - began
        resumed = self.state.resumed
        logger.info(
            "step %d %s at %s (%.1f MiB in %.2f s, %d hedged shards)",
            self.manifest.step,
            "verified and stored"
            if whole
            else f"{len(wanted)} of {len(body.shards)} shards verified and held",
            final,
            (selected - resumed) / 2**20,
            seconds,
            self.state.hedges,
        )
        return FetchResult(
            manifest=self.manifest,
            version_dir=final,
            held=None if whole else frozenset(self.partial.done),
            fetched_bytes=selected - resumed,
            resumed_bytes=resumed,
            received_bytes=self.state.received,
            hedges=self.state.hedges,
            hedges_won=self.state.hedges_won,
            seconds=seconds,
            sources=[s.report() for s in self.pool.sources.values()],
        )

    async def _download_all(self) -> None:
        saver = asyncio.create_task(self._journal(), name="weights-fetch-journal")
        peering = asyncio.create_task(self.peering.run(), name="weights-fetch-peering")
        peering.add_done_callback(self._peering_ended)
        try:
            await self.scheduler.run()
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
        if not task.cancelled() and task.exception() is not None and self.state.error is None:
            # A bug of ours: the fetch stops with it rather than running blind.
            self.state.error = task.exception()
            self.changed.set()

    async def _stop_threads(self) -> None:
        self.cancelled.set()
        self.ctx.connections.abort()  # unblock reads now rather than after a stall timeout
        tasks = [a.task for a in self.state.attempts() if a.task is not None]
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

    async def _finish_part(self) -> Path:
        """Every selected shard verified: the version stays under .partial/, its journal (durable when the
        settings ask) listing what it holds, so that a later, wider fetch resumes from it."""
        await self._stop_threads()
        await asyncio.to_thread(shutil.rmtree, self.hedge_dir, True)
        if self.settings.durable:  # the shards first: a journal on disk must never list bytes that are not
            await asyncio.to_thread(self.partial.fsync)
        snapshot = self.partial.progress_snapshot()
        await asyncio.to_thread(self.partial.write_progress, snapshot, durable=self.settings.durable)
        await asyncio.to_thread(self.ctx.store.note_held, self.manifest.step)
        return self.partial.directory

    async def _save_progress(self) -> None:
        await asyncio.to_thread(self.partial.write_progress, self.partial.progress_snapshot())

    async def _journal(self) -> None:
        while True:
            await asyncio.sleep(self.settings.save_interval_s)
            if self.state.dirty:
                self.state.dirty = False
                await self._save_progress()
