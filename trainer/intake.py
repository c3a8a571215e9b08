"""Admission and fair scheduling of received rollout files: per-node token buckets and a round-robin queue.

A validator verifies far fewer files per second than a hostile peer can send. Two mechanisms keep one
flooding peer from starving the others:
- admission (before the file's body is read): each node has a token bucket (`rate_per_minute`, `burst`),
  and the queue has a global bound and a per-node bound; a refused sender is told to retry later, which
  is the back-pressure;
- scheduling: the queue holds one FIFO per node and serves the nodes in turn, so an honest node's file
  waits behind at most one file of each other node, however many a flooder has queued.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")

# Token buckets kept; the idlest are forgotten first (a forgotten node starts again with a full bucket).
MAX_TRACKED_NODES = 100_000


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class RateLimiter:
    """One token bucket per node id: `burst` tokens at most, refilled at `rate_per_minute`."""

    def __init__(
        self, rate_per_minute: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate_per_s = rate_per_minute / 60.0
        self.burst = float(burst)
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def try_take(self, node_id: str) -> float:
        """0.0 when a token was taken; otherwise the seconds until the next token (nothing taken)."""
        now = self._clock()
        bucket = self._buckets.pop(node_id, None) or _Bucket(self.burst, now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.stamp) * self.rate_per_s)
        bucket.stamp = now
        self._buckets[node_id] = bucket  # most recently used last
        if len(self._buckets) > MAX_TRACKED_NODES:
            self._buckets.popitem(last=False)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate_per_s if self.rate_per_s > 0 else float("inf")


@dataclass
class FairQueue(Generic[Item]):
    """A FIFO per node, served round-robin across nodes; `get` waits for an item.

    Unbounded by itself: the service bounds what it admits (IntakeSettings), and files recovered after a
    restart or released from a hold must be queued whatever the bounds say, never dropped.
    """

    _lanes: OrderedDict[str, deque[Item]] = field(default_factory=OrderedDict)
    _size: int = 0
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def __len__(self) -> int:
        return self._size

    def put(self, node_id: str, item: Item, *, front: bool = False) -> None:
        lane = self._lanes.get(node_id)
        if lane is None:
            lane = self._lanes[node_id] = deque()
        if front:
            lane.appendleft(item)
        else:
            lane.append(item)
        self._size += 1
        self._ready.set()

    async def get(self) -> Item:
        while not self._lanes:
            self._ready.clear()
            await self._ready.wait()
        node_id, lane = next(iter(self._lanes.items()))
        item = lane.popleft()
        del self._lanes[node_id]
        if lane:
            self._lanes[node_id] = lane  # to the back of the rotation: the other nodes go first
        self._size -= 1
        return item
