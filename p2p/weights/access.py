"""Who may download from a weights server: a ban list (node ids, addresses, networks) and per-client rate limits.

Address bans are enforced on the TCP peer address. Node-id bans match the X-Prime-Node-Id header a
fetcher sends; that header is a claim, not a proof, so it keeps honest-but-banned nodes off a relay while
address bans are the tool against an adversary.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import WeightsError

logger = logging.getLogger(__name__)

_NODE_ID = re.compile(r"^[0-9a-f]{64}$")
MAX_TRACKED_CLIENTS = 10_000  # bound the limiter's memory under a flood of distinct addresses


class BanList:
    """Banned node ids and IP networks, from flags and an optional file re-read when it changes."""

    def __init__(self, entries: list[str] | None = None, path: Path | None = None) -> None:
        self.path = path
        self._static = list(entries or [])
        self._mtime: float | None = None
        self.node_ids: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self._apply(self._static)
        self.reload()

    def _apply(self, entries: list[str]) -> None:
        node_ids, networks = set(), []
        for raw in entries:
            entry = raw.split("#", 1)[0].strip().lower()
            if not entry:
                continue
            if _NODE_ID.match(entry):
                node_ids.add(entry)
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise WeightsError(f"ban entry {raw.strip()[:80]!r} is neither a node id (64 hex) nor an IP or network") from None
        self.node_ids, self.networks = node_ids, networks

    def reload(self) -> None:
        """Re-read the ban file if it changed (called periodically by the server)."""
        if self.path is None:
            return
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self._mtime:
            return
        lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        self._apply(self._static + lines)
        self._mtime = mtime
        logger.info("ban list %s: %d node ids, %d networks", self.path, len(self.node_ids), len(self.networks))

    def is_banned(self, address: str | None, node_id: str | None) -> bool:
        if node_id and node_id.lower() in self.node_ids:
            return True
        if not address:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self.networks)


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class RateLimiter:
    """A token bucket per client address: `rate` requests per second, bursts up to `burst`."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self._buckets: dict[str, _Bucket] = {}

    def allow(self, client: str) -> tuple[bool, float]:
        """(allowed, seconds until the next token) for one request from `client`."""
        if self.rate <= 0:
            return True, 0.0
        now = time.monotonic()
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= MAX_TRACKED_CLIENTS:
                self._evict(now)
            bucket = self._buckets[client] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.stamp) * self.rate)
        bucket.stamp = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True, 0.0
        return False, (1.0 - bucket.tokens) / self.rate

    def _evict(self, now: float) -> None:
        full = [k for k, b in self._buckets.items() if b.tokens + (now - b.stamp) * self.rate >= self.burst]
        for key in full or list(self._buckets)[: len(self._buckets) // 2]:
            del self._buckets[key]
