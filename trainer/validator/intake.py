"""Fair scheduling of received rollout files: tiers of nodes and a round-robin queue per tier.

A validator verifies far fewer files per second than a hostile peer can send. Two mechanisms keep one
flooding peer from starving the others:
- admission (before the file's body is read; trainer/validator/admission.py): each node has a token bucket
  (`rate_per_minute`, `burst`; p2p/rate_limit.py), and the queue has a global bound and a per-node bound;
  a refused sender is told to retry later, which is the back-pressure;
- scheduling: the queue holds one FIFO per node and serves the nodes in turn, so an honest node's file
  waits behind at most one file of each other node, however many a flooder has queued.
Many fresh node ids (a Sybil flood) would defeat both, so nodes come in two tiers
(trainer/validator/admission.py decides which): established nodes, with verified work in the ledger, and
newcomers. `TieredQueue` keeps one FairQueue per tier and gives newcomers a bounded share of the verification
turns, so however many newcomer ids flood, an established node's file waits behind a number of files that
depends only on the established nodes.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

Item = TypeVar("Item")


class Tier(str, Enum):
    ESTABLISHED = "established"  # accepted work in the ledger: keeps its reserved share of the queue
    NEWCOMER = "newcomer"  # no accepted work yet: shares a small bounded slice with every other newcomer


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
        return self.pop()

    def pop(self) -> Item:
        """The next item in the rotation without waiting; IndexError when empty."""
        if not self._lanes:
            raise IndexError("pop from an empty FairQueue")
        node_id, lane = next(iter(self._lanes.items()))
        item = lane.popleft()
        del self._lanes[node_id]
        if lane:
            self._lanes[node_id] = lane  # to the back of the rotation: the other nodes go first
        self._size -= 1
        return item


class TieredQueue(Generic[Item]):
    """A FairQueue per tier; newcomers get `newcomer_share` of the turns while established files wait.

    When only one tier has files it is served at full speed, so an idle swarm of established nodes does not
    slow newcomers down. The share is kept with a credit counter (deterministic, no randomness to game).
    """

    def __init__(self, newcomer_share: float) -> None:
        if not 0.0 < newcomer_share < 1.0:
            raise ValueError(f"newcomer_share must be in (0, 1), got {newcomer_share}")
        self.newcomer_share = newcomer_share
        self._tiers: dict[Tier, FairQueue[Item]] = {tier: FairQueue() for tier in Tier}
        self._credit = 0.0
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return sum(len(q) for q in self._tiers.values())

    def waiting(self, tier: Tier) -> int:
        return len(self._tiers[tier])

    def put(self, tier: Tier, node_id: str, item: Item, *, front: bool = False) -> None:
        self._tiers[tier].put(node_id, item, front=front)
        self._ready.set()

    async def get(self) -> Item:
        while not len(self):
            self._ready.clear()
            await self._ready.wait()
        established, newcomers = self._tiers[Tier.ESTABLISHED], self._tiers[Tier.NEWCOMER]
        if not newcomers:
            return established.pop()
        if not established:
            return newcomers.pop()
        self._credit += self.newcomer_share
        if self._credit >= 1.0:
            self._credit -= 1.0
            return newcomers.pop()
        return established.pop()
