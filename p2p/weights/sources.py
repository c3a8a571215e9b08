"""Which source serves the next shard: a weighted draw over measured bandwidth and reliability.

Each source's weight is EMA(bandwidth) x EMA(success) + a healing term. The healing term (a small share of
the best bandwidth, plus a success score that recovers with time since the last failure) means a slow or
failed source is tried again later instead of being shunned forever; an exponential cooldown after
consecutive failures means it is not hammered meanwhile. A source that served corrupt data is penalised
harder than one that merely failed, and a source whose manifest did not verify is excluded outright (until
the manifest it serves turns out to be the chosen one: a late source joins). A transfer that lost its shard
to a faster copy (a hedge) feeds its measured rate into the bandwidth EMA, so a drip-feeding source that
never completes a shard still ends up weighing next to nothing.

A source that signs availability records (availability.py) is asked only for the shards it claims; one that
does not (an origin, a relay without an identity) is taken to hold every shard its manifest lists. A peer the
swarm advertised (`claimants` set) is never taken to hold anything unsigned: only what a current record signed
by a node id that names it claims, the first such record binding it to that node (`node_id`). A source
that claimed a shard and then did not serve it (503, 404), or sent a record that does not verify, has lied:
its weight is multiplied by `lie_penalty` for each lie, on top of the failure's own cooldown.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

NOT_READY_PAUSE_S = (
    0.25  # longest pause of a source after a 503, whatever its Retry-After (that is per shard)
)
# A source's "not ready" 503s in a row (no shard verified from it since) that cost it no pause of ours, the
# first pause past them, and the longest it doubles up to: an honest busy server's Retry-After (server.py
# `busy_retry_s`), so that one is never paused longer than it asks (`record_not_ready`).
NOT_READY_FREE_IN_ROW = 8
NOT_READY_FLOOR_S = 0.05
NOT_READY_BACKOFF_MAX_S = 0.2


class SelectionSettings(BaseModel):
    """How sources are scored and how failures back off."""

    model_config = ConfigDict(extra="forbid")

    ema_alpha: float = Field(0.3, gt=0, le=1, description="Weight of the newest observation in the EMAs.")
    heal_share: float = Field(0.05, ge=0, le=1, description="Healing term: this share of the best bandwidth.")
    heal_per_second: float = Field(
        0.05, ge=0, description="Success score regained per second since a failure."
    )
    corrupt_penalty: float = Field(
        0.1, ge=0, le=1, description="Success score is multiplied by this on bad data."
    )
    backoff_base_s: float = Field(0.25, gt=0, description="Cooldown after the first consecutive failure.")
    backoff_max_s: float = Field(30.0, gt=0, description="Longest cooldown after repeated failures.")
    lie_penalty: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Weight multiplier per lie about availability (a claimed shard not served).",
    )


@dataclass
class SourceState:
    """What the fetcher has learnt about one source during this fetch."""

    url: str
    bandwidth: float | None = None  # EMA of bytes/s over completed shard transfers; None until measured
    success: float = 1.0  # EMA of 1 (shard verified) / 0 (failed, corrupt, or not served: busy, not ready)
    failures_in_row: int = 0
    last_failure: float = 0.0
    cooldown_until: float = 0.0
    excluded: str | None = None  # why this source is not used at all (e.g. its manifest did not verify)
    shards_ok: int = 0
    shards_failed: int = 0
    shards_corrupt: int = 0
    shards_lost: int = 0  # transfers cancelled because a faster copy of their shard verified first
    not_ready: int = 0  # 503 answers (a relay still mirroring, a server with every upload slot busy)
    not_ready_in_row: int = 0  # those since it last served a verified shard (`record_not_ready`: which count)
    hints: int = 0  # 503 answers naming another shard to ask for instead (a super-seeding origin, seeding.py)
    bytes_ok: int = 0
    errors: list[str] = field(default_factory=list)
    # Availability (availability.py): None until known. `records` False: the source signs none (404), so it is
    # taken to hold every shard; True: `have` is what its newest verified record claims.
    records: bool | None = None
    have: frozenset[int] | None = None
    record_ms: int = -1  # issued_at_ms of the newest record taken (an older one is a replay: ignored)
    lies: int = 0  # claimed shards it then did not serve, and records that did not verify
    # A peer the swarm advertised (a heartbeat's weights URL): the node ids whose heartbeats name it (claims.py).
    # Empty: an origin or relay the caller chose. `node_id` is the one it is bound to: the sole claimant, or the
    # one whose current signed record it served first (peering.py); None while a contested server has not said.
    # It is asked only for shards a current record of that node claims, and dropped from the fetch when it sends
    # bytes that do not match the manifest.
    claimants: frozenset[str] = frozenset()
    node_id: str | None = None

    @property
    def advertised(self) -> bool:
        return bool(self.claimants)

    def signers(self) -> frozenset[str] | None:
        """Whose availability records this source may serve: its bound node id, else any claimant; None for an
        origin or relay (any valid key: it is trusted with what it serves)."""
        if self.node_id is not None:
            return frozenset({self.node_id})
        return self.claimants or None

    def claimed_by(self, claimants: frozenset[str]) -> None:
        """Make this an advertised peer named by `claimants`: bound at once when there is only one."""
        self.claimants = claimants
        self.node_id = next(iter(claimants)) if len(claimants) == 1 else None

    def holds(self, index: int) -> bool:
        """Whether this source may be asked for shard `index`: it signs no claims at all, or it claims it.
        Until its first answer is in (one round trip), nothing: a peer is never asked blind."""
        if self.records is None:
            return False
        return self.have is None or index in self.have

    def report(self) -> dict[str, object]:
        return {
            "url": self.url,
            "node_id": self.node_id,
            "claimants": sorted(self.claimants),
            "bandwidth_mib_s": round((self.bandwidth or 0.0) / 2**20, 2),
            "success": round(self.success, 3),
            "shards_ok": self.shards_ok,
            "shards_failed": self.shards_failed,
            "shards_corrupt": self.shards_corrupt,
            "shards_lost": self.shards_lost,
            "not_ready": self.not_ready,
            "hints": self.hints,
            "lies": self.lies,
            "bytes_ok": self.bytes_ok,
            "excluded": self.excluded,
            "last_errors": self.errors[-3:],
        }


class SourcePool:
    """The sources of one fetch and the weighted draw among them."""

    def __init__(
        self,
        urls: list[str],
        settings: SelectionSettings | None = None,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or SelectionSettings()
        self.sources = {url: SourceState(url) for url in urls}
        self.rng = rng or random.Random()
        self.clock = clock

    def usable(self) -> list[SourceState]:
        return [s for s in self.sources.values() if s.excluded is None]

    def askable(self) -> list[SourceState]:
        """Usable sources that shards can be asked from: an advertised peer only once a record it signed
        verified. One that never signs is never asked, so it must not keep a failing fetch waiting either."""
        return [s for s in self.usable() if not s.advertised or s.records]

    def weight(self, source: SourceState, now: float, best: float | None = None) -> float:
        if source.excluded is not None or now < source.cooldown_until:
            return 0.0
        best = best or self._best()
        bandwidth = source.bandwidth or best  # optimistic for the unmeasured, so every source gets tried
        healed = min(
            1.0, source.success + self.settings.heal_per_second * max(0.0, now - source.last_failure)
        )
        return (bandwidth * healed + self.settings.heal_share * best) * self.settings.lie_penalty**source.lies

    def pick(
        self, avoid: Collection[str] = (), forbid: Collection[str] = ()
    ) -> tuple[SourceState | None, float]:
        """Draw a source, preferring those not in `avoid` and never one in `forbid`; returns (None, seconds to
        wait) when every candidate is cooling down, (None, 0) when there is no candidate at all."""
        now = self.clock()
        allowed = [s for s in self.usable() if s.url not in forbid]
        candidates = [s for s in allowed if s.url not in avoid] or allowed
        best = self._best()
        weights = [self.weight(s, now, best) for s in candidates]
        if not candidates:
            return None, 0.0
        if sum(weights) <= 0:
            return None, max(0.01, min(s.cooldown_until for s in candidates) - now)
        return self.rng.choices(candidates, weights=weights, k=1)[0], 0.0

    def _best(self) -> float:
        known = [s.bandwidth for s in self.sources.values() if s.bandwidth]
        return max(known) if known else 1.0

    def record_success(self, source: SourceState, nbytes: int, seconds: float) -> None:
        a = self.settings.ema_alpha
        rate = nbytes / max(seconds, 1e-6)
        source.bandwidth = rate if source.bandwidth is None else a * rate + (1 - a) * source.bandwidth
        source.success = a + (1 - a) * source.success
        source.failures_in_row = 0
        source.not_ready_in_row = 0
        source.shards_ok += 1
        source.bytes_ok += nbytes

    def best_bandwidth(self, exclude: str) -> float | None:
        """The highest measured bandwidth among the usable sources other than `exclude` that are not cooling down."""
        now = self.clock()
        rates = [
            s.bandwidth for s in self.usable() if s.url != exclude and s.bandwidth and now >= s.cooldown_until
        ]
        return max(rates) if rates else None

    def record_slow(self, source: SourceState, rate: float) -> None:
        """A transfer lost its shard to a faster copy: its rate (bytes/s) counts as a bandwidth sample."""
        a = self.settings.ema_alpha
        source.bandwidth = rate if source.bandwidth is None else a * rate + (1 - a) * source.bandwidth
        source.shards_lost += 1

    def record_not_ready(self, source: SourceState, pause_s: float = 0.0, *, counted: bool = True) -> None:
        """A relay has not verified a shard yet, or a server has no free upload slot (503): no charge (no
        failure counted, no back-off), but a sample of the source's health: it did not serve, so its success
        score falls as for a failure and heals with time the same way, and a source that is always busy is
        drawn less often than one that serves. A busy server is not asked again for `pause_s` (at most
        NOT_READY_PAUSE_S), so that it is not hammered with requests it cannot serve.

        Whatever it asks for (a Retry-After of 0 included), a source whose counted not-ready answers in a row
        pass NOT_READY_FREE_IN_ROW is paused too: NOT_READY_FLOOR_S after the first answer past them, doubled for
        each further one, up to NOT_READY_BACKOFF_MAX_S; a verified shard from it starts the count again.
        Without it, a source that answered "not verified yet, Retry-After: 0" for every shard was asked again as
        soon as it answered, for the whole fetch (831-1349 requests in a 1.3 s fetch beside an honest source).
        Why a count in a row and not a floor on every pause: honest sources give a few such answers between
        shards (a relay behind the fetcher, each answer after holding the request for `shard_wait_s`; a server
        whose upload slots are all taken), and below the count their answers are treated exactly as before.
        Why no longer than NOT_READY_BACKOFF_MAX_S: an honest busy server asks for that, and a relay or server
        that becomes ready is asked again as soon as that; a source that keeps answering so, serving nothing,
        is asked about as often as an honest busy one.

        `counted` False: an answer that says nothing about the source's pace, neither counted nor paused here:
        a super-seeding hint within its source's budget (outcomes.py `hinted`: it has its own budget, and a
        followed hint goes out at once), and the answer to a blind ask, for a shard the source never said it
        holds (scheduler.py asks a source that signs records for a shard nobody claims yet; a relay still
        mirroring answers it at once, and counting those paused relays that were about to verify the shard:
        `benchmarks/broadcast.py --modes relays` ran about 7% slower)."""
        now = self.clock()
        source.not_ready += 1
        source.success = (1 - self.settings.ema_alpha) * source.success
        source.last_failure = now  # the healing term runs from here, as after a failure
        pause_s = min(pause_s, NOT_READY_PAUSE_S)
        if counted:
            source.not_ready_in_row += 1
            past = source.not_ready_in_row - NOT_READY_FREE_IN_ROW
            if past > 0:  # the exponent is capped before the power: the count has no bound of its own
                backoff = NOT_READY_FLOOR_S * 2 ** min(past - 1, 16)
                pause_s = max(pause_s, min(backoff, NOT_READY_BACKOFF_MAX_S))
        if pause_s > 0:
            source.cooldown_until = max(source.cooldown_until, now + pause_s)

    def record_failure(self, source: SourceState, reason: str, *, corrupt: bool = False) -> None:
        a = self.settings.ema_alpha
        now = self.clock()
        source.success = (1 - a) * source.success * (self.settings.corrupt_penalty if corrupt else 1.0)
        source.failures_in_row += 1
        source.last_failure = now
        delay = self.settings.backoff_base_s * 2 ** (source.failures_in_row - 1)
        source.cooldown_until = now + min(self.settings.backoff_max_s, delay)
        if corrupt:
            source.shards_corrupt += 1
        else:
            source.shards_failed += 1
        source.errors.append(reason)
        del source.errors[:-10]

    def record_lie(self, source: SourceState, reason: str) -> None:
        """It claimed what it did not serve (or signed a bad record): a corrupt failure, and demoted for good."""
        source.lies += 1
        self.record_failure(source, reason, corrupt=True)

    def exclude(self, url: str, reason: str) -> None:
        self.sources[url].excluded = reason
        self.sources[url].errors.append(reason)
        del self.sources[url].errors[:-10]

    def include(self, url: str) -> None:
        """Use a source excluded so far (its manifest arrived late and is the chosen one)."""
        self.sources[url].excluded = None
