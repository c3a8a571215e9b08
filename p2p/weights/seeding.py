"""Super-seeding at the origin: while some shard of a version has never been sent, each shard goes out once.

An origin feeding a swarm of re-serving peers (docs/weights.md, "Peers re-serve what they verified") is the
only holder at first, and its uplink is the swarm's bottleneck until every shard has left it once: each node
asks it for the shards none of the few peers it knows holds, so without a global view the origin sent the
same shard to several nodes while others had left it not at all (2 to 2.25 copies of the checkpoint at
N = 8 and 32, docs/network.md "Checkpoint broadcast"). With `ServeSettings.super_seed`, a request for a shard
already sent (or being sent) while some other shard has never gone out is answered 503 with SEED_HEADER
naming one never-sent shard, drawn at random so that refused requesters spread; the fetcher asks for that
one instead (attempt_runner.py) and gets the refused shard from the peer that received it. Once every shard
has gone out once the origin serves whatever it is asked, so the phase lasts one copy of the checkpoint and
a node can never be kept from a shard for longer. It also ends after MAX_REFUSALS_WITHOUT_PROGRESS refusals
in a row while no never-sent shard began: fetchers that want none of the never-sent shards (pipeline stages
fetching their own layers, docs/pipeline.md "Selective download") would otherwise be refused for good.

A send counts from its first byte; one that ends before its last byte (a lost hedge, a client gone) is
uncounted, so a requester that aborts cannot mark a shard as given. A client that downloads every shard ends
the phase early, which costs it a whole checkpoint and leaves the origin as it was without super-seeding.
Only a server that signs no availability records seeds (server.py refuses the combination): one that signed
that it holds a shard and then refused it would be taken for a liar.
"""

from __future__ import annotations

import random

SEED_HEADER = "X-Prime-Node-Seed"  # on a 503: this shard was sent already; the named one never was
# Refusals in a row, while no never-sent shard began, after which a version's phase ends. A fetcher that takes
# the hint starts the named shard at once, so in a swarm that wants every shard a few refusals separate two
# first sends; only requesters that want none of the never-sent shards pile them up.
MAX_REFUSALS_WITHOUT_PROGRESS = 64


class SeedLedger:
    """Per version served, how many sends of each shard began and did not fail; bounded by the versions kept."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._sent: dict[int, list[int]] = {}  # step -> sends per shard index
        self._stalled: dict[int, int] = {}  # step -> refusals since a never-sent shard last began
        self._over: set[int] = set()  # steps whose phase ended by refusals without progress
        self._rng = rng or random.Random()

    def instead(self, step: int, count: int, index: int) -> int | None:
        """A never-sent shard to ask for instead of `index`, or None when `index` may be sent now."""
        sent = self._counts(step, count)
        if sent[index] == 0 or step in self._over:
            return None
        never = [i for i, n in enumerate(sent) if n == 0]
        if not never:
            return None
        stalled = self._stalled[step] = self._stalled.get(step, 0) + 1
        if stalled > MAX_REFUSALS_WITHOUT_PROGRESS:
            self._over.add(step)
            return None
        return self._rng.choice(never)

    def started(self, step: int, count: int, index: int) -> None:
        sent = self._counts(step, count)
        if sent[index] == 0:
            self._stalled[step] = 0
        sent[index] += 1

    def failed(self, step: int, index: int) -> None:
        """A send that began did not reach its last byte: the shard is not in the swarm through it."""
        sent = self._sent.get(step)
        if sent is not None and sent[index] > 0:
            sent[index] -= 1

    def keep_only(self, steps: set[int]) -> None:
        """Forget versions no longer served."""
        for step in [s for s in self._sent if s not in steps]:
            del self._sent[step]
            self._stalled.pop(step, None)
            self._over.discard(step)

    def _counts(self, step: int, count: int) -> list[int]:
        sent = self._sent.get(step)
        if sent is None or len(sent) != count:
            sent = self._sent[step] = [0] * count
            self._stalled.pop(step, None)
            self._over.discard(step)
        return sent
