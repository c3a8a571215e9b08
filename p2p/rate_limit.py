"""Per-key rate limits: one token bucket per key (a client address, a node id), with bounded memory.

Used wherever a peer's requests are counted before they cost us anything: the weights server per client
address (p2p/weights/server.py), the validator's admission per node id (trainer/validator/admission.py).
A refusal says how long until the next token, which the caller hands back as its retry hint.

Memory is bounded by `max_keys`, because keys are free for a flooder to make (addresses, fresh node ids).
When the table is full, the buckets that have refilled to `burst` go first: forgetting one changes nothing,
since an unknown key starts with a full bucket. Only when those are too few are the least recently used
buckets forgotten too (such a key starts again with a full bucket: the unavoidable price of a bound). Each
sweep frees at least a quarter of the table, so its cost is spread over that many new keys.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    stamp: float  # clock reading when `tokens` was last brought up to date


class TokenBuckets:
    """A token bucket per key: `burst` tokens at most, refilled at `rate_per_s` (0 or less: no limit)."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        *,
        max_keys: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or max_keys < 1:
            raise ValueError(f"burst and max_keys must be at least 1, got {burst} and {max_keys}")
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        """Keys whose bucket is remembered."""
        return len(self._buckets)

    def take(self, key: str) -> float:
        """0.0 when a token was taken for `key`; otherwise the seconds until its next token (nothing taken)."""
        if self.rate_per_s <= 0:
            return 0.0
        now = self._clock()
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._sweep(now)
            bucket = _Bucket(self.burst, now)
        bucket.tokens = self._level(bucket, now)
        bucket.stamp = now
        self._buckets[key] = bucket  # most recently used last
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate_per_s

    def _level(self, bucket: _Bucket, now: float) -> float:
        # max(0, ...): a clock that steps back must not drain a bucket
        return min(self.burst, bucket.tokens + max(0.0, now - bucket.stamp) * self.rate_per_s)

    def _sweep(self, now: float) -> None:
        """Forget every full bucket, then the least recently used ones until a quarter of the table is free."""
        for key in [k for k, b in self._buckets.items() if self._level(b, now) >= self.burst]:
            del self._buckets[key]
        target = self.max_keys - max(1, self.max_keys // 4)
        while len(self._buckets) > target:
            self._buckets.popitem(last=False)
