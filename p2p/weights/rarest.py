"""The shards a fetch still has to ask for, handed out rarest first.

In a swarm where nodes re-serve each shard as soon as it verified, what a node fetches decides what it can
give: if every node took shard 0, then 1, then 2 from the origin, they would all hold the same shards and
have nothing to trade. So the next shard is the one the fewest sources claim to hold (their signed
availability records, availability.py), and among equally rare shards a per-fetch random order decides,
which spreads nodes that start together over different shards. Sources without records (an origin, a
relay) hold everything and add the same count to every shard, so they do not change the order.

A shard put back after a failed attempt goes first, as before rarest-first: it was chosen already. One put back
after a 503 (not there yet, or no free upload slot) rejoins the others in their order instead.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterable, Iterator


class ShardQueue:
    """Indices of shards not yet asked for (or put back), in the order they should be asked for."""

    def __init__(self, missing: Iterable[int], count: int, rng: random.Random | None = None) -> None:
        self._waiting = set(missing)
        self._retry: collections.deque[int] = collections.deque()  # put back: asked for before the rest
        order = list(range(count))
        (rng or random.Random()).shuffle(order)
        self._rank = [0] * count
        for position, index in enumerate(order):
            self._rank[index] = position
        self.copies = [0] * count  # sources whose records claim each shard
        self._order: list[int] | None = None  # cached rarest-first order of the waiting shards

    def __len__(self) -> int:
        return len(self._waiting) + len(self._retry)

    def __bool__(self) -> bool:
        return bool(self._waiting or self._retry)

    def __contains__(self, index: object) -> bool:
        """Whether shard `index` waits to be asked for (not taken since it was queued)."""
        return index in self._waiting or index in self._retry

    def first(self) -> int:
        return next(self.candidates())

    def candidates(self) -> Iterator[int]:
        """Waiting shards, put-back ones first, then the rarest; the caller `take`s the one it starts."""
        yield from list(self._retry)
        if self._order is None:
            self._order = sorted(self._waiting, key=lambda i: (self.copies[i], self._rank[i]))
        for index in self._order:
            if index in self._waiting:
                yield index

    def take(self, index: int) -> None:
        if index in self._waiting:
            self._waiting.discard(index)
        else:
            self._retry.remove(index)

    def put_back(self, index: int, *, first: bool = True) -> None:
        """Queue `index` again: first (after a failure: it was chosen already), or among the waiting shards in
        rarest-first order (after a 503: asked first again, it would keep shards the source does hold waiting)."""
        if first:
            self._retry.appendleft(index)
        else:
            self._waiting.add(index)
            self._order = None

    def claims_changed(self, before: frozenset[int] | None, after: frozenset[int] | None) -> None:
        """A source's record went from claiming `before` to `after` (None: no record counted)."""
        old, new = before or frozenset(), after or frozenset()
        if old == new:
            return
        for index in new - old:
            self.copies[index] += 1
        for index in old - new:
            self.copies[index] -= 1
        self._order = None
