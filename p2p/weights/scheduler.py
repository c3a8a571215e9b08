"""The scheduler of a shard run: which shard goes to which source next, when to hedge, when to wake.

One loop on the event loop starts attempts (attempt_runner.py) while there is a free slot: `concurrency` slots
for sources that have verified a shard in this fetch, as many for probes (one shard at a time per source not
proven yet; a source's first probe does not wait for a slot). The next shard is the rarest one some free
source holds (rarest.py, from the sources' signed availability records kept by peering.py), and it goes to a
source drawn by weight (sources.py) among those that hold it; a source with a slow attempt in flight gets no
more. When no source claims any waiting shard, the first one is asked of any source that is not an advertised
peer, as before availability records existed (a 503 there is "not verified yet", not a fault). An attempt
judged slow gives up its slot, and its shard is also asked of another source (a hedge): the first copy that
verifies wins. Once every shard has been asked for (the end game), a proven source's free slot also takes a
shard held only by unproven sources. The loop wakes when an attempt ends and when the next attempt in flight
could first be judged slow were no further byte to arrive (attempts.py `next_judgment`), not on a tick: a few
wake-ups per attempt instead of one every 20 ms while any transfer runs. Sources whose manifest arrives after
the fetch started join when it is the manifest being fetched.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .attempt_runner import AttemptRunner
from .attempts import is_slow, next_judgment
from .errors import FetchError, ManifestAbsent, ManifestError
from .run_state import RunState
from .sources import SourceState

logger = logging.getLogger(__name__)

# How soon the first waiting shard is looked at again while some source has not answered its first
# availability request (it may claim the shard a round trip from now).
SCHEDULE_TICK_S = 0.02
MIN_WAKE_S = 0.002  # the shortest sleep: an attempt at its judgment time is judged again just after it
MAX_IDLE_S = 0.25  # the longest the loop sleeps with nothing to judge (late manifests are polled that often)
MAX_SCAN = 64  # waiting shards looked at for one free source, rarest first (bounds the scheduler's work)
MAX_COPIES = 3  # transfers of one shard at once: the first, and up to two hedges when each before is slow


class Scheduler:
    """Hands the waiting shards of one run to its sources; see the module docstring."""

    def __init__(self, state: RunState, runner: AttemptRunner) -> None:
        self.state = state
        self.runner = runner
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
        self.joining = state.joining
        self.peering = state.peering
        self.outcomes = state.outcomes
        self.changed = state.changed
        self.started = state.started

    async def run(self) -> None:
        """Until every wanted shard verified: admit late sources, judge, launch, then sleep until something
        changes."""
        while not self.state.holds_wanted():
            self._admit_late_sources()
            wake = self._judge(time.monotonic())
            wake = min(wake, self._launch())
            if self.state.error is not None:
                raise self.state.error
            waiting_for = (
                self.joining
                # an advertised peer's first answer, for as long as a fetch waits for first answers
                or (
                    self.peering.first_record_due()
                    and time.monotonic() < self.started + self.settings.availability_wait_s
                )
                or (self.peering.absent and not self.pool.usable())
            )
            lost = None if self.inflight or self.state.delayed else self._lost()
            if lost is not None or not (
                self.inflight or self.state.delayed or (self.queue and (self.pool.askable() or waiting_for))
            ):
                index = lost if lost is not None else self.queue.first() if self.queue else -1
                raise FetchError(
                    f"shard {index} of step {self.manifest.step} could not be fetched and verified: "
                    f"{self.outcomes.text(index) or 'no usable source'}",
                    self.outcomes.blame,
                    shard=index,
                )
            self.changed.clear()
            try:  # wake on any attempt's end, or when one in flight can next be judged
                async with asyncio.timeout(max(0.001, wake)):
                    await self.changed.wait()
            except TimeoutError:
                pass
            if self.state.error is not None:
                raise self.state.error

    def _lost(self) -> int | None:
        """A waiting shard that no source may serve any more (outcomes.py `exhausted`), if any: with nothing in
        flight, e.g. when the last holder with budget left withdrew its claim rather than failing a request."""
        askable = self.pool.askable()
        for n, index in enumerate(self.queue.candidates()):
            if n >= MAX_SCAN:
                break
            if self.outcomes.exhausted(index, askable):
                return index
        return None

    def _judge(self, now: float) -> float:
        """Mark the attempts that became slow; returns the seconds until one in flight can next be judged."""
        wake = MAX_IDLE_S
        for attempt in self.state.attempts():
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
            wake = min(wake, max(MIN_WAKE_S, next_judgment(attempt, best, self.settings) - now))
        return wake

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
        while self.state.error is None:
            attempts = self.state.attempts()
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
                    self.runner.start(index, source)
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
        if not free and all(s.cooldown_until <= now for s in usable):
            # Every source is busy: nothing can start before an attempt ends or a record arrives, and either
            # wakes the scheduler. (The common case while transfers fill every slot: no scan at all.)
            return -1, None, MAX_IDLE_S
        everything = [s for s in usable if s.records is False]  # they sign no records: hold every shard
        recordless = {s.url for s in everything}
        claims = [(s, s.have) for s in usable if s.records and s.have]  # SourceState.holds, unrolled
        free_urls = {s.url for s in free}
        for n, index in enumerate(self.queue.candidates()):
            if n >= MAX_SCAN:
                break
            holders = everything + [s for s, have in claims if index in have]
            if not holders:
                orphan = index if orphan is None else orphan
                continue
            claimed = True
            if not any(s.url in free_urls for s in holders):
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
            # A source that used its whole budget on this shard is not asked for it again (outcomes.py).
            source, cooling = self.pool.pick(avoid=avoid, forbid=taken | lacking | self.outcomes.spent(index))
            if source is not None:
                return index, source, 0.0
            if cooling:
                wait = cooling if wait is None else min(wait, cooling)
        patience = self.started + self.settings.availability_wait_s - time.monotonic()
        if orphan is not None and not claimed and self.peering.unknown() and patience > 0:
            return orphan, None, min(patience, SCHEDULE_TICK_S)  # an answer may be a round trip away
        if orphan is not None and not claimed:
            # Asked blind, as before records existed: never an advertised peer, which gets only what it signed.
            peers = {s.url for s in usable if s.advertised}
            forbid = taken | peers | self.outcomes.spent(orphan)
            source, cooling = self.pool.pick(avoid=self.tried[orphan], forbid=forbid)
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
            forbid |= self.outcomes.spent(index)
            source, _ = self.pool.pick(avoid=self.tried[index], forbid=forbid | unproven)
            if source is None and waiting:  # the end game never gives a shard to another unproven source
                source, _ = self.pool.pick(avoid=self.tried[index], forbid=forbid)
            if source is not None:
                self.state.hedges += 1
                self.runner.start(index, source)
                return True
        return False

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
