"""Source selection: draws in proportion to EMA(bandwidth) x EMA(success), healing, back-off, exclusion."""

from __future__ import annotations

import random
from collections import Counter

from prime_node.p2p.weights.sources import SelectionSettings, SourcePool


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool(urls: list[str], clock: Clock, **settings: float) -> SourcePool:
    return SourcePool(urls, SelectionSettings(**settings), rng=random.Random(0), clock=clock)


def test_draws_follow_bandwidth_times_success() -> None:
    clock = Clock()
    p = pool(["fast", "slow"], clock, heal_share=0.0)
    p.record_success(p.sources["fast"], 300, 1.0)
    p.record_success(p.sources["slow"], 100, 1.0)
    draws = Counter(p.pick()[0].url for _ in range(4000))  # type: ignore[union-attr]
    assert 0.70 < draws["fast"] / 4000 < 0.80  # 300 / (300 + 100)


def test_unmeasured_sources_are_tried_optimistically() -> None:
    clock = Clock()
    p = pool(["a", "new"], clock)
    p.record_success(p.sources["a"], 100, 1.0)
    assert p.weight(p.sources["new"], clock()) >= p.weight(p.sources["a"], clock())


def test_corrupt_data_is_penalised_harder_than_failure_and_heals_with_time() -> None:
    clock = Clock()
    p = pool(["bad", "flaky", "good"], clock, heal_per_second=0.001, heal_share=0.05)
    for s in p.sources.values():
        p.record_success(s, 100, 1.0)
    p.record_failure(p.sources["bad"], "SHA-256 mismatch", corrupt=True)
    p.record_failure(p.sources["flaky"], "reset")
    clock.now += 60  # past every cooldown
    w = {u: p.weight(s, clock()) for u, s in p.sources.items()}
    assert w["bad"] < w["flaky"] < w["good"]
    assert w["bad"] > 0  # not shunned forever: the healing term keeps it in the draw
    clock.now += 1000
    assert p.weight(p.sources["bad"], clock()) == p.weight(p.sources["good"], clock())  # healed fully


def test_consecutive_failures_back_off_exponentially_instead_of_hammering() -> None:
    clock = Clock()
    p = pool(["only"], clock, backoff_base_s=1.0, backoff_max_s=8.0)
    cooldowns = []
    for _ in range(5):
        p.record_failure(p.sources["only"], "timeout")
        source, wait = p.pick()
        assert source is None
        cooldowns.append(round(wait, 3))
    assert cooldowns == [1.0, 2.0, 4.0, 8.0, 8.0]
    clock.now += 8.0
    assert p.pick()[0] is p.sources["only"]


def test_excluded_and_avoided_sources() -> None:
    clock = Clock()
    p = pool(["a", "b", "c"], clock)
    p.exclude("c", "manifest did not verify")
    assert {p.pick(avoid={"a"})[0].url for _ in range(50)} == {"b"}  # type: ignore[union-attr]
    assert {p.pick(avoid={"a", "b"})[0].url for _ in range(50)} <= {"a", "b"}  # type: ignore[union-attr]
    assert p.sources["c"].report()["excluded"] == "manifest did not verify"
