"""Who may hand the validator a file right now, and the count of files between admission and verdict.

Admission runs on the hand-off header, before the body is read, so refusing costs the sender only a
retry. Every sender already has a live heartbeat signed by its key (the hand-off checks it), but node
ids are free to make, so the queue is split in two tiers (trainer/validator/intake.py `Tier`):

- established nodes (at least `established_after` accepted files in the ledger) share
  `queue_size - newcomer_queue` places, at most `per_node_queue` each;
- newcomers share `newcomer_queue` places, at most `newcomer_per_node` each.

A Sybil flood of fresh ids therefore fills at most the newcomer slice; established nodes keep their places.
Each node also has a token bucket (`rate_per_minute`, `burst`). A refusal for any of these is `Busy`
(back-pressure: the sender keeps the file and retries after the hint), never a verdict.

A place is reserved at admission, because the body arrives later and several hand-offs run at once: without
the reservation many headers could pass the bound before any body is stored. The reservation becomes a
counted file when the spooled file is queued, and lapses if the body never comes. Files recovered from the
spool or released from a hold are counted whatever the bounds say: an acknowledged file is never dropped.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...p2p.rate_limit import TokenBuckets
from .config import IntakeSettings
from .intake import Tier

# Token buckets kept; full ones, then the idlest, are forgotten first (p2p/rate_limit.py).
MAX_TRACKED_NODES = 100_000


@dataclass(frozen=True)
class Busy:
    """Come back later: why, and after how many seconds."""

    reason: str
    retry_after_s: float


Delivery = tuple[str, str]  # (node id, file hash): one sender's file; two senders of the same bytes are two


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
    ) -> None:
        self.settings = settings
        self.reservation_s = reservation_s  # how long a hand-off may take from header to stored body
        self._clock = clock
        self.limiter = TokenBuckets(
            settings.rate_per_minute / 60, settings.burst, max_keys=MAX_TRACKED_NODES, clock=clock
        )
        self._accepted: Counter[str] = Counter()  # accepted files per node (only counts that matter)
        self._reserved: dict[Delivery, _Place] = {}  # place taken by a hand-off in flight
        self._files: dict[Delivery, _Place] = {}  # place of a spooled file without a verdict
        self._per_node: Counter[str] = Counter()  # places per node, reserved or filled
        self._per_tier: Counter[Tier] = Counter()

    # ----- tiers -------------------------------------------------------------------------------------------

    def load_accepted(self, counts: Iterable[tuple[str, int]]) -> None:
        """Accepted-file counts per node from the ledger (at start)."""
        for node_id, count in counts:
            self._accepted[node_id] = count

    def note_accepted(self, node_id: str) -> None:
        if self._accepted[node_id] < self.settings.established_after:
            self._accepted[node_id] += 1

    def tier_of(self, node_id: str) -> Tier:
        established = self._accepted.get(node_id, 0) >= self.settings.established_after
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

    def admit(self, node_id: str, sha256: str) -> Busy | None:
        """Reserve a place for a file whose header just arrived, or say why not now."""
        self._expire()
        key = (node_id, sha256)
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

    def enqueued(self, node_id: str, sha256: str) -> Tier:
        """A spooled file enters the queue: its reservation (if any) becomes a counted file; its tier."""
        key = (node_id, sha256)
        known = self._files.get(key)
        if known is not None:
            return known.tier
        reserved = self._release(self._reserved, key)
        tier = reserved.tier if reserved is not None else self.tier_of(node_id)
        self._take(self._files, key, _Place(node_id, tier, float("inf")))
        return tier

    def cancel(self, node_id: str, sha256: str) -> None:
        """A reserved file will not be queued (it already had a verdict): free its place now."""
        self._release(self._reserved, (node_id, sha256))

    def finished(self, node_id: str, sha256: str) -> None:
        """The file has its verdict: its place is free."""
        self._release(self._files, (node_id, sha256))

    # ----- internals ---------------------------------------------------------------------------------------

    def _take(self, table: dict[Delivery, _Place], key: Delivery, place: _Place) -> None:
        table[key] = place
        self._per_node[place.node_id] += 1
        self._per_tier[place.tier] += 1

    def _release(self, table: dict[Delivery, _Place], key: Delivery) -> _Place | None:
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
