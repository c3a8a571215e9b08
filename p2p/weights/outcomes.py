"""What the end of a shard attempt means for its source: credit, a charge, or a recheck before any charge.

A failure is charged to the source of the attempt that failed, and recorded in the blame list a failed fetch
reports. One failure is not charged at once: a resumed copy (bytes on disk continued with a Range request)
whose SHA-256 does not match. Its prefix was written by the same source (attempts.py `resume_point`), but
maybe in an earlier run whose bytes our own disk may have lost. So the same source is asked for the whole
shard again (a recheck) before anyone is charged:

  * the whole shard verifies: the prefix was wrong. Written in this run, it was that source's bytes, and the
    source is charged as corrupt (it is also credited with the shard it then delivered). From an earlier
    run's journal, nobody can be blamed: it is logged, and no source is charged.
  * the whole shard fails its digest too: the source sends wrong bytes, charged as corrupt as always.
  * the recheck breaks off: charged as a failure, and as corrupt when the failed prefix was written in this
    run (every byte of the copy that mismatched came from that source).

A mismatch that cannot be attributed never counts against a source, never counts towards its
`max_attempts_per_shard`, and never discards verified shards.

Budgets are per source. Each source may fail a shard `max_attempts_per_shard` times, after which it is not
asked for that shard again (`spent`); a shard is given up only when every source that could still serve it
has spent its own budget on it (`exhausted`). So peers that claim a shard and fail it, however many, use up
only their own attempts, never the origin's. Likewise a 503 that says "not here yet" is free only
`max_not_ready` times per (source, shard), each source's own allowance. A 503 that says "busy" (every upload
slot taken) is always free: it is paced instead (the source waits out its Retry-After, and many in a row
pause it, sources.py `record_not_ready`), since an honest origin feeding a swarm can be busy for longer than
any such count allows (`not_ready`).

A super-seeding origin's 503 (seeding.py) names a shard to ask it for instead, and the fetcher asks at once
(attempt_runner.py). That hint is budgeted per source: it is followed at most once per (source, named shard),
and only while the source's hint-503s number at most `hint_budget`, the shard count plus seeding.py's
MAX_REFUSALS_WITHOUT_PROGRESS. Beyond it a hint-503 is a "not ready" answer whose hint is ignored, and it
pauses its source for NOT_READY_PAUSE_S (as a busy answer does), whatever its Retry-After. A source that
answers every request with a hint (each hinted request getting another, round the shards, for as long as the
fetch lasts) used to be asked at once after every answer, at no cost, its requests taking shards out of the
queue; now it gets `hint_budget` answers at that pace, then at most one request per NOT_READY_PAUSE_S, out of
the draw in between. Past the budget its hint-503s also count among its "not ready" answers in a row, which
pause any source that gives many (sources.py `record_not_ready`: a 503 with Retry-After 0 from a source that
serves nothing was asked again at the scheduler's pace, `max_not_ready` times per shard); within the budget
they are not counted there, so that a followed hint still goes out at once.

Why a pause and not a charge: an honest origin stays under the budget in the cases it is sized for (the
hints a fetcher follows are each a first send of a different shard, so at most the shard count; the hints it
cannot use, for a shard it holds or does not want, end the origin's phase after MAX_REFUSALS_WITHOUT_PROGRESS
in a row), but no budget for one fetcher bounds an origin in a swarm: that count starts again at every first
send anywhere, and a hint also goes unused while its shard waits out a Retry-After or the origin is paused.
Charged as failures, the extra hints would spend the origin's `max_attempts_per_shard` on one shard in a few
answers and fail a fetch whose only source is that origin (tried with a budget of the shard count alone:
the selective fetch in tests/test_weights_seeding.py failed so); paused, an honest origin past the budget
loses at most a quarter second per hint, in a phase that ends within one copy of the checkpoint anyway.

A peer the swarm advertised, bound to a node id (`SourceState.node_id`), that is charged with wrong bytes is
also dropped from the fetch (excluded, its claims withdrawn): nobody vouched for it, and every further shard
it sends would have to be received and hashed before it could be refused again. An origin or relay the
caller named is only penalised, since it may be the one source there is.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from .attempts import Attempt, Recheck
from .errors import SourceError
from .fetch_settings import FetchSettings
from .seeding import MAX_REFUSALS_WITHOUT_PROGRESS
from .sources import SourcePool, SourceState
from .transfer import DigestMismatch, ShardResult

logger = logging.getLogger(__name__)


class Outcomes:
    """Credits and charges for the attempts of one shard run, and the blame list of a failed fetch."""

    def __init__(
        self,
        pool: SourcePool,
        settings: FetchSettings,
        step: int,
        shard_count: int,
        on_drop: Callable[[SourceState], None] | None = None,
    ) -> None:
        self.pool = pool
        self.on_drop = on_drop  # a dropped peer's claims are withdrawn (peering.py `drop`)
        self.dropped: dict[str, str] = {}  # node id -> why: advertised peers caught sending wrong bytes
        self.settings = settings
        self.step = step
        # Machine-readable record of what failed where: [{shard, source, reason, corrupt}, ...] (for --json).
        self.blame: list[dict[str, object]] = []
        # (shard, source URL) -> failures charged: each source's own budget for each shard.
        self.failures: collections.Counter[tuple[int, str]] = collections.Counter()
        self._spent: dict[int, set[str]] = {}  # shard -> sources that used their whole budget on it
        self._not_ready: collections.Counter[tuple[int, str]] = collections.Counter()
        # Super-seeding hints (module docstring): the hint-503s each source may give at the fetch's pace (counted
        # in `SourceState.hints`, one fetch's), and the (shard, source) pairs whose hint was followed (bounded
        # like the counters above, by the shards and sources of one fetch).
        self.hint_budget = shard_count + MAX_REFUSALS_WITHOUT_PROGRESS
        self._followed: set[tuple[int, str]] = set()

    def hinted(self, source: SourceState) -> bool:
        """`source` answered a super-seeding 503 naming another shard: True while its hint-503s are within
        `hint_budget`; False beyond it (the hint is ignored and the source paused: module docstring). Either
        way a hint-503 with a Retry-After is a "not ready" answer (`not_ready`)."""
        source.hints += 1
        return source.hints <= self.hint_budget

    def follow_hint(self, source: SourceState, index: int) -> bool:
        """Whether `source`'s hint to ask it for shard `index` may be followed: once per (source, shard) in a
        fetch. Call only when it is about to be followed (a hint that is not wanted uses nothing)."""
        if (index, source.url) in self._followed:
            return False
        self._followed.add((index, source.url))
        return True

    def not_ready(
        self, attempt: Attempt, reason: str, pause_s: float, *, counted: bool = True, busy: bool = False
    ) -> bool:
        """The source answered 503 (not verified there yet, or every upload slot busy): True while such answers
        from this source for this shard are tolerated, without a charge or an attempt used. Each one still
        lowers the source's health (sources.py `record_not_ready`), so a source that is always busy is drawn
        less often, and many in a row pause it. `counted` False: a super-seeding hint within the source's
        budget (`hinted`), followed at once, or the answer to a blind ask: neither counted in a row nor paused
        (sources.py `record_not_ready`).

        `busy` (the 503 says every upload slot is taken) from a source the caller chose (an origin or relay, not
        an advertised peer): always tolerated, never counted towards `max_not_ready`. Such answers are paced
        already (the source waits out its Retry-After, up to NOT_READY_PAUSE_S, and many in a row pause it), so
        counting them only turned honest busyness into charges: 1000 answers at an honest server's 0.2 s are
        200 s, after which an origin busy feeding a swarm was charged failures for a shard only it held, and the
        fetch failed. An advertised peer's busy answers still count: a peer that claims every shard and answers
        busy for ever would otherwise be waited on for ever once it is the last holder a fetch may ask (no
        deadline bounds a fetch as a whole); after `max_not_ready` it is charged, as before."""
        key = (attempt.index, attempt.source.url)
        if busy and not attempt.source.advertised:
            self.pool.record_not_ready(attempt.source, pause_s, counted=counted)
            return True
        if self._not_ready[key] >= self.settings.max_not_ready:
            return False
        self._not_ready[key] += 1
        self.pool.record_not_ready(attempt.source, pause_s, counted=counted)
        return True

    def lied(self, attempt: Attempt, reason: str) -> None:
        """The source's signed availability record claims the shard, and it did not serve it."""
        source, index = attempt.source, attempt.index
        why = f"claimed shard {index} in its signed availability record, then answered: {reason}"
        self.pool.record_lie(source, f"shard {index}: {why}")
        self.blame.append({"shard": index, "source": source.url, "reason": why, "corrupt": True})
        self._count_failure(index, source.url)
        logger.warning("source %s: %s", source.url, why)

    def verified(self, attempt: Attempt, result: ShardResult) -> None:
        self.pool.record_success(attempt.source, result.received, result.seconds)
        if attempt.recheck is not None:
            self._judge_prefix(attempt, attempt.recheck, "its copy from byte 0 verified")

    def failed(self, attempt: Attempt, failure: SourceError) -> Recheck | None:
        """Charge `failure` to the attempt's source; or, for a resumed copy that failed its digest, charge no
        one yet and return the recheck to run."""
        if isinstance(failure, DigestMismatch) and attempt.resumed and attempt.recheck is None:
            assert attempt.progress is not None  # a resumed attempt writes in place
            logger.info(
                "shard %d: the copy %s resumed at byte %d failed its digest; asking it for the whole shard "
                "before charging anyone",
                attempt.index,
                attempt.source.url,
                attempt.start,
            )
            return Recheck(attempt.start, attempt.progress.journaled, failure.reason)
        reason, corrupt = failure.reason, failure.corrupt
        if attempt.recheck is not None and not attempt.recheck.journaled:
            reason, corrupt = f"{reason}, after its resumed copy failed: {attempt.recheck.reason}", True
        self._charge(attempt, reason, corrupt=corrupt)
        return None

    def settle_recheck(self, attempt: Attempt, recheck: Recheck) -> None:
        """The recheck cannot run (another copy of the shard decides it): judge the failed prefix as it stands."""
        self._judge_prefix(attempt, recheck, "no recheck was needed")

    def spent(self, index: int) -> set[str]:
        """The sources that used their whole budget on shard `index`: it is not asked of them again."""
        return self._spent.get(index, set())

    def exhausted(self, index: int, askable: list[SourceState]) -> bool:
        """Whether shard `index` is lost: some source spent its budget on it, and so did every other that could
        still serve it (it signs no records, or its record claims the shard). A peer that does not claim it is
        not waited for then: the fetch fails, and the caller's next try (pinned.py backs off) finds what the
        peers hold by then."""
        spent = self.spent(index)
        return bool(spent) and all(
            s.url in spent or (s.have is not None and index not in s.have) for s in askable
        )

    def text(self, index: int) -> str:
        return "; ".join(f"{b['source']}: {b['reason']}" for b in self.blame if b["shard"] == index)

    def _judge_prefix(self, attempt: Attempt, recheck: Recheck, how: str) -> None:
        if recheck.journaled:
            logger.info(
                "shard %d: the first %d bytes, resumed from an earlier run, did not verify (%s); not "
                "attributable to %s (the disk may have lost them), so nobody is charged",
                attempt.index,
                recheck.prefix_bytes,
                how,
                attempt.source.url,
            )
            return
        self._charge(
            attempt,
            f"the first {recheck.prefix_bytes} bytes it sent were wrong ({recheck.reason}; {how})",
            corrupt=True,
        )

    def _charge(self, attempt: Attempt, reason: str, *, corrupt: bool) -> None:
        source, index = attempt.source, attempt.index
        self.pool.record_failure(source, f"shard {index}: {reason}", corrupt=corrupt)
        self.blame.append({"shard": index, "source": source.url, "reason": reason, "corrupt": corrupt})
        self._count_failure(index, source.url)
        logger.warning("source %s: shard %d: %s", source.url, index, reason)
        # A peer is asked for a shard only once bound (peering.py), so `node_id` names the node that sent it.
        if corrupt and source.node_id is not None and source.excluded is None:
            why = f"peer {source.node_id[:16]}… sent shard {index} not matching the signed manifest; dropped"
            self.pool.exclude(source.url, why)
            self.dropped[source.node_id] = why
            if self.on_drop is not None:
                self.on_drop(source)
            logger.warning(
                "peer %s (%s…) dropped from the fetch of step %d", source.url, source.node_id[:16], self.step
            )

    def _count_failure(self, index: int, url: str) -> None:
        self.failures[(index, url)] += 1
        if self.failures[(index, url)] >= self.settings.max_attempts_per_shard:
            self._spent.setdefault(index, set()).add(url)
