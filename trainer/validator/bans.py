"""Keep the DHT's ban records in step with the ledger: published while a ban is in force, never longer.

A DHT record lives `ttl` seconds and must be republished to last. For each banned node the publisher
stores the ban that ends last (a permanent one first) with

    ttl = min(time left of the ban, swarm.ban_ttl_s)

and stores it again every `validator.ban_republish_s` (below `swarm.ban_ttl_s`, so a record never lapses
while the validator runs). A timed ban's last record therefore expires exactly when the ban ends, and a
permanent ban is refreshed for as long as the validator runs. A ban the operator lifts leaves the ledger's
active set and is not republished: its last record expires within `swarm.ban_ttl_s` (a DHT record cannot
be withdrawn early; lower `swarm.ban_ttl_s` to shorten that tail, at the cost of more republishing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...p2p.errors import P2PError
from ...p2p.identity import Identity
from ...p2p.swarm import Swarm
from ...p2p.verdicts import sign
from ..ledger import AsyncLedger, BanEntry

logger = logging.getLogger(__name__)

MIN_TTL_S = 0.05  # a ban about to end is not worth a DHT store
MAX_TICK_S = 60.0


@dataclass(frozen=True)
class _Stored:
    ban_id: int
    stored_at: float
    expires: float


class BanPublisher:
    """Publishes the ledger's bans in force; `sync` is idempotent and cheap when nothing is due."""

    def __init__(
        self,
        ledger: AsyncLedger,
        swarm: Swarm,
        identity: Identity,
        *,
        record_ttl_s: float,
        republish_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < republish_s < record_ttl_s:
            raise ValueError(
                f"bans must be republished (every {republish_s} s) before their records expire "
                f"({record_ttl_s} s)"
            )
        self.ledger = ledger
        self.swarm = swarm
        self.identity = identity
        self.record_ttl_s = record_ttl_s
        self.republish_s = republish_s
        self._clock = clock
        self._stored: dict[str, _Stored] = {}  # node id -> the ban record this process last stored

    def record_ttl(self, ban: BanEntry, now: float) -> float | None:
        """Lifetime of the record to store now; None when the ban is over."""
        left = float("inf") if ban.until is None else ban.until - now
        if ban.lifted_at is not None or left < MIN_TTL_S:
            return None
        return min(left, self.record_ttl_s)

    def due(self, ban: BanEntry, now: float) -> bool:
        stored = self._stored.get(ban.node_id)
        if stored is None or stored.ban_id != ban.id:
            return True  # never published by this process, or a longer ban replaced the one published
        if ban.until is not None and stored.expires >= ban.until:
            return False  # the stored record already lasts until the ban ends
        return now >= stored.stored_at + self.republish_s

    async def publish(self, ban: BanEntry) -> bool:
        """Store the ban's record now (and keep its signed BanRecord in the ledger); False if not stored."""
        now = self._clock()
        ttl = self.record_ttl(ban, now)
        if ttl is None:
            return False
        try:
            stored = await self.swarm.publish_ban(ban.node_id, ban.reason, ttl_s=ttl)
        except (P2PError, OSError, EOFError) as exc:  # DHT unreachable for now: the next sync retries
            logger.warning("ban of %s not published yet: %s", ban.node_id[:16], exc)
            return False
        if not stored:
            logger.warning("no DHT peer stored the ban of %s; retrying at the next round", ban.node_id[:16])
            return False
        self._stored[ban.node_id] = _Stored(ban.id, now, now + ttl)
        if ban.record is None:
            signed = sign(ban.to_record(self.identity.node_id), self.identity)
            await self.ledger.attach_ban_record(ban.id, signed)
        return True

    async def sync(self) -> int:
        """Publish every ban in force that is due; forget bans lifted or over. Returns how many it stored."""
        now = self._clock()
        current = _latest_per_node(await self.ledger.active_bans(now))
        for node_id in set(self._stored) - set(current):
            del self._stored[node_id]  # lifted or ended: its record is left to expire
        published = 0
        for ban in current.values():
            if self.due(ban, now):
                published += int(await self.publish(ban))
        return published

    async def run(self) -> None:
        """Sync forever, often enough to republish each record well before it expires."""
        tick = min(self.republish_s / 2, MAX_TICK_S)
        while True:
            await self.sync()
            await asyncio.sleep(tick)


def _latest_per_node(bans: list[BanEntry]) -> dict[str, BanEntry]:
    """The ban in force per node is the one that ends last, a permanent one first (as Ledger.active_ban)."""
    best: dict[str, BanEntry] = {}
    for ban in bans:
        held = best.get(ban.node_id)
        if held is None or _ends(ban) > _ends(held):
            best[ban.node_id] = ban
    return best


def _ends(ban: BanEntry) -> float:
    return float("inf") if ban.until is None else ban.until
