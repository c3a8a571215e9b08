"""The one per-key rate limiter (p2p/rate_limit.py) the weights server and the validator's admission share.

Every test drives an injected clock, so none of them sleeps. The real paths are covered beside the users:
tests/test_weights_server.py (429 with Retry-After) and tests/test_validator_admission.py.
"""

from __future__ import annotations

import pytest

from prime_node.p2p.rate_limit import TokenBuckets


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate_and_each_key_has_its_own_bucket() -> None:
    clock = Clock()
    buckets = TokenBuckets(1.0, 3, max_keys=10, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(1.0)  # empty: the next token in one second
    assert buckets.take("b") == 0.0  # another key has its own bucket
    clock.now += 0.5
    assert buckets.take("a") == pytest.approx(0.5)  # a refusal takes nothing
    clock.now += 0.5
    assert buckets.take("a") == 0.0


def test_refill_stops_at_the_burst_and_a_clock_stepping_back_drains_nothing() -> None:
    clock = Clock()
    buckets = TokenBuckets(2.0, 3, max_keys=10, clock=clock)
    buckets.take("a")
    clock.now += 3600  # an hour idle earns 3 tokens, not 7200
    assert [buckets.take("a") for _ in range(4)] == [0.0, 0.0, 0.0, pytest.approx(0.5)]
    clock.now -= 50
    assert buckets.take("a") == pytest.approx(0.5)


def test_a_rate_of_zero_is_no_limit() -> None:
    buckets = TokenBuckets(0.0, 1, max_keys=1, clock=Clock())
    assert {buckets.take(str(i % 3)) for i in range(1000)} == {0.0}
    assert len(buckets) == 0


def test_memory_stays_bounded_under_a_flood_of_keys() -> None:
    clock = Clock()
    buckets = TokenBuckets(0.001, 1, max_keys=64, clock=clock)
    for i in range(10_000):
        buckets.take(f"flood-{i}")
        assert len(buckets) <= 64
        clock.now += 0.001


def test_full_buckets_are_forgotten_before_a_throttled_one_even_when_it_is_the_idlest() -> None:
    # The throttled key is the least recently used: forgetting by age alone would hand it a fresh burst.
    clock = Clock()
    buckets = TokenBuckets(1.0, 2, max_keys=4, clock=clock)
    assert [buckets.take("hog"), buckets.take("hog")] == [0.0, 0.0]
    clock.now += 0.5
    for key in ("a", "b", "c"):
        buckets.take(key)  # one token left each
    clock.now += 1.0  # a, b, c are full again; the hog has 1.5 tokens
    buckets.take("newcomer")  # the table is full: a sweep
    assert len(buckets) == 2
    assert [buckets.take("hog"), buckets.take("hog")] == [0.0, pytest.approx(0.5)]


def test_without_full_buckets_the_idlest_go_first() -> None:
    clock = Clock()
    buckets = TokenBuckets(0.001, 1, max_keys=8, clock=clock)
    for i in range(8):
        buckets.take(f"k{i}")  # every bucket empty
    assert buckets.take("k0") > 0  # refused, but k0 is now the most recently used
    buckets.take("newcomer")  # sweep: down to three quarters, the idlest first
    assert len(buckets) == 7
    assert buckets.take("k0") > 0  # still throttled
    assert buckets.take("k7") > 0  # recent enough to be kept
    assert buckets.take("k1") == 0.0  # forgotten: a fresh bucket, the price of the bound


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        TokenBuckets(1.0, 0, max_keys=1)
    with pytest.raises(ValueError):
        TokenBuckets(1.0, 1, max_keys=0)
