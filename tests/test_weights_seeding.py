"""Super-seeding at the origin (p2p/weights/seeding.py): each shard goes out once before any goes out twice."""

from __future__ import annotations

import random
import time
from pathlib import Path

import aiohttp
import pytest

from prime_node.p2p.weights.errors import WeightsError
from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
from prime_node.p2p.weights.manifest import SignedManifest
from prime_node.p2p.weights.outcomes import Outcomes
from prime_node.p2p.weights.seeding import MAX_REFUSALS_WITHOUT_PROGRESS, SEED_HEADER, SeedLedger
from prime_node.p2p.weights.selection import Selection
from prime_node.p2p.weights.server import ServeSettings, WeightsServer
from prime_node.p2p.weights.sources import NOT_READY_PAUSE_S, SelectionSettings, SourcePool
from prime_node.p2p.weights.store import Store

from support.weights import operator, publish_steps, same_tree, serving

FAST = FetchSettings(
    stall_timeout_s=3.0,
    connect_timeout_s=3.0,
    manifest_timeout_s=5.0,
    durable=False,
    concurrency=1,
    selection=SelectionSettings(backoff_base_s=0.02, backoff_max_s=0.2),
)


async def get(url: str, **headers: str) -> tuple[int, dict[str, str]]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


def test_ledger_names_a_never_sent_shard_until_each_went_out_once() -> None:
    ledger = SeedLedger(random.Random(1))
    assert ledger.instead(5, 3, 0) is None  # nothing sent yet: anything may go
    ledger.started(5, 3, 0)
    assert ledger.instead(5, 3, 0) in (1, 2)
    ledger.started(5, 3, 1)
    assert ledger.instead(5, 3, 0) == 2 and ledger.instead(5, 3, 1) == 2
    ledger.failed(5, 1)  # cut before its last byte: shard 1 is not out
    assert ledger.instead(5, 3, 1) is None
    ledger.started(5, 3, 1)
    ledger.started(5, 3, 2)
    assert ledger.instead(5, 3, 0) is None  # every shard went out once: the phase is over
    ledger.keep_only(set())
    assert ledger.instead(5, 3, 0) is None and ledger.instead(5, 3, 1) is None


async def test_origin_sends_each_shard_once_before_any_twice(tmp_path: Path) -> None:
    manifest = publish_steps(tmp_path, operator(), [3])[3]
    count = len(manifest.body.shards)
    async with serving(tmp_path / "origin", super_seed=True) as server:
        base = f"{server.url}/v1/weights/3/shards"
        assert (await get(f"{base}/0"))[0] == 200
        status, headers = await get(f"{base}/0")
        assert status == 503 and headers["Retry-After"] == "0"
        hinted = int(headers[SEED_HEADER])
        assert 0 < hinted < count
        # A range that stops short of the shard's end does not count as sending it.
        assert (await get(f"{base}/{hinted}", Range="bytes=0-9"))[0] == 206
        assert (await get(f"{base}/{hinted}"))[0] == 200
        for index in range(1, count):
            if index != hinted:
                assert (await get(f"{base}/{index}"))[0] == 200
        assert (await get(f"{base}/0"))[0] == 200  # every shard went out once: served as asked


async def test_super_seeding_is_refused_for_a_server_that_signs_availability(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="super_seed"):
        WeightsServer(Store(tmp_path), ServeSettings(port=0, super_seed=True), identity=operator(3))


async def test_fetcher_asks_for_the_shard_the_origin_names(tmp_path: Path) -> None:
    """All but one shard went out already: the fetcher's first refused request names the one left, which it
    asks for next; after that the origin serves everything. Without taking the hint it would draw refused
    shards at random, about half of them before the one left."""
    manifest = publish_steps(tmp_path, operator(), [3])[3]
    count = len(manifest.body.shards)
    assert count >= 16
    left = count // 2
    async with serving(tmp_path / "origin", super_seed=True) as server:
        for index in range(count):
            if index != left:
                assert (await get(f"{server.url}/v1/weights/3/shards/{index}"))[0] == 200
        fetcher = Fetcher([server.url], operator().node_id, Store(tmp_path / "out"), FAST)
        result = await fetcher.fetch()
        assert same_tree(result.checkpoint_dir, tmp_path / "src-3")
        (origin,) = result.sources
        assert isinstance(origin["not_ready"], int) and origin["not_ready"] <= 1, origin


def test_the_phase_ends_when_nobody_asks_for_the_never_sent_shards() -> None:
    """Fetchers that want none of the never-sent shards (a pipeline stage's selective fetch) are refused a
    bounded number of times, not for good."""
    ledger = SeedLedger(random.Random(2))
    ledger.started(4, 3, 0)
    refused = 0
    while ledger.instead(4, 3, 0) is not None:
        refused += 1
        assert refused <= MAX_REFUSALS_WITHOUT_PROGRESS
    assert refused == MAX_REFUSALS_WITHOUT_PROGRESS and ledger.instead(4, 3, 0) is None
    # A first send in between starts the count again.
    ledger.keep_only(set())
    ledger.started(4, 3, 0)
    for _ in range(MAX_REFUSALS_WITHOUT_PROGRESS):
        assert ledger.instead(4, 3, 0) is not None
    ledger.started(4, 3, 1)
    assert ledger.instead(4, 3, 0) == 2


class AllBut:
    """A selection plan (p2p/weights/selection.py) wanting every shard but one."""

    def __init__(self, left_out: int) -> None:
        self.left_out = left_out

    def choose(self, manifest: SignedManifest, checkpoint_dir: Path, held: frozenset[int]) -> Selection:
        return Selection.of(manifest, set(range(len(manifest.body.shards))) - {self.left_out})


async def test_hints_a_fetcher_cannot_use_cost_an_honest_origin_nothing(tmp_path: Path) -> None:
    """The one never-sent shard is one this fetch does not want (a selective fetch; a resumed one holding it
    is alike): every request is refused naming it, the hint is ignored, and after MAX_REFUSALS_WITHOUT_PROGRESS
    refusals in a row the origin's phase ends and it serves. Those hint-503s are within the fetcher's hint
    budget (outcomes.py, the shard count plus that many): no pause, no charge. With a budget of the shard
    count alone each hint past it would have paused the origin, the only source, for NOT_READY_PAUSE_S (here
    about 10 s in all)."""
    manifest = publish_steps(tmp_path, operator(), [3])[3]
    count = len(manifest.body.shards)
    left = count // 2
    async with serving(tmp_path / "origin", super_seed=True) as server:
        for index in range(count):
            if index != left:
                assert (await get(f"{server.url}/v1/weights/3/shards/{index}"))[0] == 200
        fetcher = Fetcher([server.url], operator().node_id, Store(tmp_path / "out"), FAST)
        began = time.monotonic()
        try:
            result = await fetcher.fetch_version(await fetcher.resolve(3), AllBut(left))
        finally:
            fetcher.close()
        elapsed = time.monotonic() - began
    (origin,) = result.sources
    assert origin["hints"] == MAX_REFUSALS_WITHOUT_PROGRESS > count, origin
    assert origin["shards_failed"] == 0 and origin["last_errors"] == [], origin
    assert origin["shards_ok"] == count - 1
    assert elapsed < (MAX_REFUSALS_WITHOUT_PROGRESS - count) * NOT_READY_PAUSE_S / 2, f"took {elapsed:.1f} s"


def test_a_hint_is_followed_once_per_source_and_shard_and_free_up_to_the_budget() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    pool = SourcePool(urls)
    outcomes = Outcomes(pool, FAST, 3, 10)
    a, b = (pool.sources[u] for u in urls)
    assert outcomes.follow_hint(a, 4) and not outcomes.follow_hint(a, 4)
    assert outcomes.follow_hint(a, 5) and outcomes.follow_hint(b, 4)  # another shard, another source
    assert outcomes.hint_budget == 10 + MAX_REFUSALS_WITHOUT_PROGRESS
    assert all(outcomes.hinted(a) for _ in range(outcomes.hint_budget))
    assert not outcomes.hinted(a) and outcomes.hinted(b)  # a's budget is spent, b's is its own
    assert a.hints == outcomes.hint_budget + 1 and b.hints == 1
