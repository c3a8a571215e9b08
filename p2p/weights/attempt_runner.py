"""The attempts of a shard run: each started, run on a worker thread, and settled on the event loop.

An attempt (attempts.py) transfers one shard from one source, into place or into a side file when another
copy of the shard already writes in place (a hedge). Its end is settled here: the first copy that verifies
wins (the others are cut at their next chunk boundary and charged their measured rate); a failure is charged
to its source alone (outcomes.py) and the shard goes back to the queue; a source that claimed the shard in
its signed availability record and answers a shard-level 404 or a plain 503 for it has lied, and is demoted;
one that answers "no such version" withdrew the version (an honest server that dropped or pruned it): its
claims are cleared and asked for again, and it is charged a plain failure, not a lie; a 503 from a relay
still mirroring, or a server with no free upload slot, costs no attempt (`max_not_ready` times per source and
shard, busy answers without limit; past a few such answers in a row from one source, each pauses it a little
longer, sources.py `record_not_ready`), and a super-seeding origin's 503 naming another shard is followed at
once, within that source's hint budget (outcomes.py). The fetch fails only when every source that could still
serve a shard (it signs no records, or claims the shard) has failed it `max_attempts_per_shard` times
(outcomes.py: budgets are per source).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from .attempts import Attempt, Recheck, fresh_hasher, install_side, resume_point, side_writer
from .errors import FetchError, SourceError
from .run_state import RunState
from .sources import NOT_READY_PAUSE_S, SourceState
from .store import ShardProgress
from .transfer import ShardFailure, ShardResult, TransferCancelled, download_shard, rehash, shard_path
from .watchdog import Watch

# The longest received bytes wait on a worker thread before the event loop counts them.
REPORT_INTERVAL_S = 0.05


class AttemptRunner:
    """Starts and settles the shard attempts of one run; see the module docstring."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.ctx = state.ctx
        self.settings = state.settings
        self.manifest = state.manifest
        self.shards = state.shards
        self.partial = state.partial
        self.pool = state.pool
        self.queue = state.queue
        self.inflight = state.inflight
        self.tried = state.tried
        self.asked = state.asked
        self.winners = state.winners
        self.reported = state.reported
        self.peering = state.peering
        self.outcomes = state.outcomes
        self.changed = state.changed
        self.cancelled = state.cancelled
        self.hedge_dir = state.hedge_dir
        self.threads = state.threads
        self.loop = state.loop

    def start(self, index: int, source: SourceState, recheck: Recheck | None = None) -> None:
        """Start an attempt at shard `index` from `source` (a recheck: the whole shard again, from byte 0)."""
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
            self.state.serial += 1
            side = self.hedge_dir / f"{index}.{self.state.serial}"
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
            if self.state.error is None:
                self.state.error = exc
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
        # Received bytes reach the event loop at most every REPORT_INTERVAL_S (and once at the end), not per
        # chunk: each report wakes the loop through its self-pipe, which cost more CPU than the count is worth.
        unreported, reported_at = 0, time.monotonic()

        def on_chunk(offset: int, n: int) -> None:
            nonlocal unreported, reported_at
            if progress is not None:
                progress.done_bytes = offset  # only after the bytes are written: the journal never runs ahead
            unreported += n
            now = time.monotonic()
            if now - reported_at >= REPORT_INTERVAL_S:
                self.loop.call_soon_threadsafe(self._count, attempt, unreported)
                unreported, reported_at = 0, now

        fd: int | None = None
        try:
            if progress is not None:
                hasher = rehash(self.partial, index, attempt.start) if attempt.start else fresh_hasher()
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
            return download_shard(
                self.ctx.connections,
                attempt.source.url,
                path,
                hasher=fresh_hasher(),
                sink=sink,
                on_chunk=on_chunk,
                **common,
            )
        finally:
            if fd is not None:
                os.close(fd)  # by the thread that wrote it, after its last write
            if unreported:  # before the attempt's result: the loop runs callbacks in the order they came
                self.loop.call_soon_threadsafe(self._count, attempt, unreported)

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
            self.state.hedges_won += 1
        self.outcomes.verified(attempt, result)
        self.state.resumed += attempt.start if attempt.in_place else 0
        self.partial.done[index] = result.digest
        self.partial.progress.pop(index, None)
        rest = self.shards[index].size - self.reported.get(index, 0)
        self.reported[index] = self.shards[index].size
        if rest > 0 and self.ctx.on_bytes is not None:
            self.ctx.on_bytes(rest)
        self.state.dirty = True
        if self.ctx.on_shard is not None:
            self.ctx.on_shard(index)

    def _count(self, attempt: Attempt, n: int) -> None:
        """On the event loop, per chunk written: bytes received, and progress of the in-place copy (once)."""
        self.state.received += n
        if not attempt.in_place or attempt.index in self.winners or attempt.watch.cancelled:
            return
        size = self.shards[attempt.index].size
        add = min(n, size - self.reported.get(attempt.index, 0))
        if add > 0:
            self.reported[attempt.index] = self.reported.get(attempt.index, 0) + add
            self.state.dirty = True
            if self.ctx.on_bytes is not None:
                self.ctx.on_bytes(add)

    def _failed(self, attempt: Attempt, failure: SourceError) -> Recheck | None:
        """Charge a failed attempt and queue its shard again; returns a Recheck when nobody may be charged yet."""
        index = attempt.index
        others = [a for a in self.inflight.get(index, []) if a is not attempt]
        claimed = attempt.source.have
        busy = isinstance(failure, ShardFailure) and failure.busy
        withdrawn = isinstance(failure, ShardFailure) and failure.withdrawn
        if withdrawn and claimed is not None:
            # "No such version": it dropped or pruned the version since it signed its claims, which an honest
            # server does. Its claims are void and it is asked again; this attempt is charged as what it is, a
            # plain failure, below.
            self.peering.withdrawn(attempt.source)
        # A shard-level 404 or a plain 503 ("not verified here") deny holding the shard; a busy 503 says it is
        # held but every upload slot is taken, which is no lie.
        refused = (failure.status == 404 and not withdrawn) or (failure.status == 503 and not busy)
        if claimed is not None and index in claimed and refused:
            # It signed that it holds the shard: not serving it is a lie, charged and demoted for good.
            self.outcomes.lied(attempt, failure.reason)
            self.queue.claims_changed(claimed, claimed - {index})
            attempt.source.have = claimed - {index}
            if not others and index not in self.winners:
                self._give_up_or_requeue(index)
            return None
        # A super-seeding origin's 503 naming another shard (seeding.py): followed only within the source's hint
        # budget (outcomes.py `hinted`); beyond it ignored, and the source paused as if busy, so that hints
        # cannot keep it asked for ever at once.
        hint = failure.instead if isinstance(failure, ShardFailure) else None
        pause_s = (failure.retry_after or 0.0) if busy else 0.0
        if hint is not None and not self.outcomes.hinted(attempt.source):
            hint, pause_s = None, NOT_READY_PAUSE_S
        # Any other "not ready" answer (a 503 with a Retry-After: busy, not verified there yet, an ignored hint)
        # to a request for a shard the source holds (it signs no records, or claims it) pauses its source once
        # it has given many in a row (sources.py `record_not_ready`): a Retry-After of 0 cannot keep a source
        # that serves nothing asked at once. A blind ask's answer is not counted: the source said nothing false.
        retry_after = failure.retry_after
        counted = hint is None and attempt.source.holds(index)
        if retry_after is not None and self.outcomes.not_ready(
            attempt, failure.reason, pause_s, counted=counted, busy=busy
        ):
            # A relay still mirroring this shard, or a server with no free upload slot: no penalty and no
            # attempt used; other holders are tried at once, and when every holder was, it waits Retry-After.
            if not others and index not in self.winners:
                holders = {u.url for u in self.pool.usable()} - self.peering.lacking(index)
                everyone = (holders or {u.url for u in self.pool.usable()}) <= self.tried[index]
                self.state.requeue(index, retry_after if everyone else 0.0, first=False)
            if hint is not None:
                # A super-seeding origin sent this shard to someone already and named one it never sent: asked
                # for at once, once this attempt has left the in-flight table (call_soon runs after it).
                self.loop.call_soon(self._ask_instead, attempt.source, hint)
            return None
        if attempt.in_place and (failure.corrupt or attempt.recheck is not None):
            self.partial.progress.pop(index, None)  # wrong bytes, or bytes no verified copy vouches for
            self.state.dirty = True
        recheck = self.outcomes.failed(attempt, failure)
        if recheck is not None or others or index in self.winners:
            return recheck  # the recheck, or the other copy, carries on
        self._give_up_or_requeue(index)
        return None

    def _ask_instead(self, source: SourceState, index: int) -> None:
        """Start shard `index` from `source` if it named it (a super-seeding origin's 503) and the shard is still
        waiting here: a hint about a shard this fetch does not want, holds, or has in flight is ignored."""
        if self.state.error is not None or self.cancelled.is_set():
            return
        if index not in self.queue or self.inflight.get(index) or index in self.winners:
            return
        # Asked only of a source that holds the shard, or (as the scheduler asks one) of a source that is not an
        # advertised peer and has not answered its first availability request yet.
        holds = source.holds(index) or (source.records is None and not source.advertised)
        if source.excluded is not None or not holds or source.url in self.outcomes.spent(index):
            return
        if self.pool.clock() < source.cooldown_until:
            return
        if not self.outcomes.follow_hint(source, index):  # once per (source, shard): no chain runs for ever
            return
        self.queue.take(index)
        self.start(index, source)

    def _give_up_or_requeue(self, index: int) -> None:
        """After a charge: end the fetch when no source may serve shard `index` any more, else queue it again."""
        if self.outcomes.exhausted(index, self.pool.askable()):
            self.state.error = FetchError(
                f"shard {index} of step {self.manifest.step} could not be fetched and verified: "
                f"{self.outcomes.text(index)}",
                self.outcomes.blame,
                shard=index,
            )
            return
        self.state.requeue(index, 0.0)

    def _recheck(self, attempt: Attempt, recheck: Recheck) -> None:
        """Ask the same source for the whole shard, once its resumed copy's attempt is gone."""
        if self.state.error is not None or self.cancelled.is_set():
            return
        if self.inflight.get(attempt.index) or attempt.index in self.winners:
            self.outcomes.settle_recheck(attempt, recheck)  # another copy decides the shard
            return
        self.start(attempt.index, attempt.source, recheck)
