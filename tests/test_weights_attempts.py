"""When an attempt in flight is judged slow, and when the scheduler must next look at it (attempts.py)."""

from __future__ import annotations

import math

import pytest

from prime_node.p2p.weights.attempts import Attempt, is_slow, judge_at, next_judgment
from prime_node.p2p.weights.fetch_settings import FetchSettings
from prime_node.p2p.weights.sources import SourceState
from prime_node.p2p.weights.watchdog import Watch


@pytest.mark.parametrize("best", [None, 2.0e6])
@pytest.mark.parametrize("received", [0, 1, 40_000, 500_000, 999_999, 1_000_000])
def test_an_attempt_is_never_slow_before_its_next_judgment_and_is_slow_just_after_without_new_bytes(
    best: float | None, received: int
) -> None:
    # The scheduler sleeps until next_judgment instead of judging on a tick: that must be exactly the moment
    # the attempt turns slow when no further byte arrives (earlier would waste wake-ups, later miss a hedge).
    settings = FetchSettings(min_rate_bytes_s=50_000, hedge_after_s=0.5, hedge_ratio=4.0)
    watch = Watch(deadline_s=1000.0)
    watch.received = received
    attempt = Attempt(0, SourceState("http://a:1"), 1_000_000, 0, watch)
    at = next_judgment(attempt, best, settings)
    if received == 1_000_000 and best is not None:
        assert at == math.inf  # every byte is in: being verified, never slow next to a measured source
        return
    assert at >= judge_at(attempt, best, settings)
    assert not is_slow(attempt, best, at - 1e-6, settings)
    assert is_slow(attempt, best, at + 1e-6, settings)
    watch.received += 1  # a byte more only ever puts the judgment later
    assert next_judgment(attempt, best, settings) >= at
