"""Who may hand the validator a file right now, and the count of files between admission and verdict.

Admission runs on the hand-off header, before the body is read, so refusing costs the sender only a
retry. Every sender already has a live heartbeat signed by its key (the hand-off checks it), but node
ids are free to make, so the queue is split in two tiers (trainer/validator/intake.py `Tier`):

- established nodes (at least `established_after` files accepted here within the last `established_window_s`)
  share `queue_size - newcomer_queue` places, at most `per_node_queue` each;
- newcomers share `newcomer_queue` places, at most `newcomer_per_node` each.

A Sybil flood of fresh ids therefore fills at most the newcomer slice; established nodes keep their places.
The same tier decides who may use the receive slots reserved for established nodes (p2p/swarm/slots.py).
Standing is recent volume, not one file ever: each id of a Sybil farm would have to keep doing verified work
at an honest node's pace to keep it, and an id that stops working falls back to the newcomers' share.
Each node also has a token bucket (`rate_per_minute`, `burst`). A refusal for any of these is `Busy`
(back-pressure: the sender keeps the file and retries after the hint), never a verdict.

A place is reserved at admission, because the body arrives later and several hand-offs run at once: without
the reservation many headers could pass the bound before any body is stored. The reservation becomes a
counted file when the spooled file is queued, and lapses if the body never comes. Files recovered from the
spool or released from a hold are counted whatever the bounds say: an acknowledged file is never dropped.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...p2p.rate_limit import TokenBuckets
from ...p2p.swarm import DeliveryKey
from .config import IntakeSettings
from .intake import Tier

# Token buckets kept; full ones, then the idlest, are forgotten first (p2p/rate_limit.py).
MAX_TRACKED_NODES = 100_000
MIN_SHARE = 0.01  # the least an accepted file counts towards standing (a stage of a model of 100 layers)


@dataclass(frozen=True)
class Busy:
    """Come back later: why, and after how many seconds."""

    reason: str
    retry_after_s: float


@dataclass(frozen=True)
class _Place:
    node_id: str
    tier: Tier
    expires: float  # monotonic time; only reservations expire


class Admission:
    """The intake bounds of trainer/validator/admission.py's docstring over one validator's queue."""

    def __init__(
        self,
        settings: IntakeSettings,
        *,
        reservation_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.reservation_s = reservation_s  # how long a hand-off may take from header to stored body
        self._clock = clock
        self._wall_clock = wall_clock  # standing is kept in the ledger's times (verdicts' decided_at)
        self.limiter = TokenBuckets(
            settings.rate_per_minute / 60, settings.burst, max_keys=MAX_TRACKED_NODES, clock=clock
        )
        # Per node, (time, credit share) of its newest accepted files, newest last: the fewest newest ones whose
        # shares reach established_after (a pipelined stage's file counts its share of the batch, as its credit).
        self._accepted: dict[str, deque[tuple[float, float]]] = {}
        self._reserved: dict[DeliveryKey, _Place] = {}  # place taken by a hand-off in flight
        self._files: dict[DeliveryKey, _Place] = {}  # place of a spooled file without a verdict
        self._per_node: Counter[str] = Counter()  # places per node, reserved or filled
        self._per_tier: Counter[Tier] = Counter()

    # ----- tiers -------------------------------------------------------------------------------------------

    def standing_since(self) -> float:
        """The wall-clock time from which accepted files count towards standing."""
        return self._wall_clock() - self.settings.established_window_s

    def load_accepted(self, accepted: Iterable[tuple[str, float, float]]) -> None:
        """(node id, decided_at, credit share) of files the ledger accepted since `standing_since()`, oldest first
        (at start)."""
        for node_id, decided_at, share in accepted:
            self.note_accepted(node_id, decided_at, share)

    def note_accepted(self, node_id: str, decided_at: float | None = None, share: float = 1.0) -> None:
        """One more file of `node_id` accepted, at `decided_at` (default now), credited `share` of a batch."""
        files = self._accepted.get(node_id)
        if files is None:
            files = self._accepted[node_id] = deque()
        # At least MIN_SHARE each: the deque stays bounded (established_after / MIN_SHARE files) whatever a
        # ledger holds.
        files.append((self._wall_clock() if decided_at is None else decided_at, max(MIN_SHARE, share)))
        total = sum(weight for _, weight in files)
        while len(files) > 1 and total - files[0][1] >= self.settings.established_after:
            total -= files.popleft()[1]

    def tier_of(self, node_id: str) -> Tier:
        times = self._accepted.get(node_id)
        if times is None:
            return Tier.NEWCOMER
        since = self.standing_since()
        if times[-1][0] < since:  # nothing accepted within the window: forget the node
            del self._accepted[node_id]
            return Tier.NEWCOMER
        total = sum(weight for _, weight in times)
        established = total >= self.settings.established_after - 1e-9 and times[0][0] >= since
        return Tier.ESTABLISHED if established else Tier.NEWCOMER

    def capacity(self, tier: Tier) -> int:
        s = self.settings
        return s.newcomer_queue if tier is Tier.NEWCOMER else s.queue_size - s.newcomer_queue

    def per_node_limit(self, tier: Tier) -> int:
        s = self.settings
        return s.newcomer_per_node if tier is Tier.NEWCOMER else s.per_node_queue

    # ----- counting ----------------------------------------------------------------------------------------

    def in_tier(self, tier: Tier) -> int:
        """Places taken in `tier`: files waiting for a verdict plus hand-offs in flight."""
        self._expire()
        return self._per_tier[tier]

    def of_node(self, node_id: str) -> int:
        self._expire()
        return self._per_node[node_id]

    def admit(self, key: DeliveryKey) -> Busy | None:
        """Reserve a place for a file whose header just arrived, or say why not now."""
        self._expire()
        node_id = key.node_id
        if key in self._files or key in self._reserved:
            return None  # already counted: a resend, or the same file on a second stream
        tier = self.tier_of(node_id)
        if self._per_tier[tier] >= self.capacity(tier):
            return Busy(
                f"the validator's queue for {tier.value} nodes is full ({self.capacity(tier)} files); "
                "retry later",
                self.settings.busy_retry_s,
            )
        limit = self.per_node_limit(tier)
        if self._per_node[node_id] >= limit:
            return Busy(
                f"this {tier.value} node already has {limit} files waiting for verification; retry later",
                self.settings.busy_retry_s,
            )
        wait = self.limiter.take(node_id)
        if wait > 0:
            return Busy(
                f"rate limit: {self.settings.rate_per_minute:g} files per minute; retry in {wait:.1f} s", wait
            )
        self._take(self._reserved, key, _Place(node_id, tier, self._clock() + self.reservation_s))
        return None

    def enqueued(self, key: DeliveryKey) -> Tier:
        """A spooled file enters the queue: its reservation (if any) becomes a counted file; its tier."""
        known = self._files.get(key)
        if known is not None:
            return known.tier
        reserved = self._release(self._reserved, key)
        tier = reserved.tier if reserved is not None else self.tier_of(key.node_id)
        self._take(self._files, key, _Place(key.node_id, tier, float("inf")))
        return tier

    def cancel(self, key: DeliveryKey) -> None:
        """A reserved file will not be queued (it already had a verdict): free its place now."""
        self._release(self._reserved, key)

    def finished(self, key: DeliveryKey) -> None:
        """The file has its verdict: its place is free."""
        self._release(self._files, key)

    # ----- internals ---------------------------------------------------------------------------------------

    def _take(self, table: dict[DeliveryKey, _Place], key: DeliveryKey, place: _Place) -> None:
        table[key] = place
        self._per_node[place.node_id] += 1
        self._per_tier[place.tier] += 1

    def _release(self, table: dict[DeliveryKey, _Place], key: DeliveryKey) -> _Place | None:
        place = table.pop(key, None)
        if place is not None:
            self._per_node[place.node_id] -= 1
            if self._per_node[place.node_id] <= 0:
                del self._per_node[place.node_id]
            self._per_tier[place.tier] -= 1
        return place

    def _expire(self) -> None:
        now = self._clock()
        for key in [key for key, place in self._reserved.items() if place.expires <= now]:
            self._release(self._reserved, key)
