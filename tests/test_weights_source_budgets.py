"""Each source answers for itself: a withdrawn version, failures and busy answers count against their own source.

A server that dropped a version since it signed its claims says "no such version": a plain failure, its claims
cleared, never a lie. Failures of a shard are budgeted per source, and so are "not ready" answers, so peers
that claim a shard and fail it, however many, cannot use up the attempts of the origin that actually holds it:
one transient failure of the origin no longer ends the fetch. Busy answers (every upload slot taken) are
tolerated without limit, paced instead, so an origin busy for long is never charged for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from pathlib import Path

import pytest

from prime_node.p2p.identity import Identity
from prime_node.p2p.weights.attempts import Attempt
from prime_node.p2p.weights.availability import sign_availability
from prime_node.p2p.weights.connections import ConnectionPool
from prime_node.p2p.weights.errors import FetchError
from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
from prime_node.p2p.weights.outcomes import Outcomes
from prime_node.p2p.weights.sources import NOT_READY_PAUSE_S, SelectionSettings, SourcePool, SourceState
from prime_node.p2p.weights.store import Store
from prime_node.p2p.weights.transfer import ShardFailure, download_shard
from prime_node.p2p.weights.watchdog import Watch

from support.weights import HostileSource, hostile, operator, publish_steps, same_tree, serving

SETTINGS = FetchSettings(
    stall_timeout_s=5.0,
    connect_timeout_s=1.0,
    manifest_timeout_s=2.0,
    durable=False,
    availability_interval_s=0.05,
    selection=SelectionSettings(backoff_base_s=0.02, backoff_max_s=0.2),
)
PEER = Identity.from_seed(b"\x05" * 32)
SYBILS = [operator(20 + i) for i in range(3)]
# Longer than the sybils take to answer for shard 0: until the origin's availability answer is in, it is not
# known to hold anything, so shard 0 goes to every sybil that claims it before the origin is asked.
ORIGIN_LATE_S = 0.5


@pytest.fixture
def origin(tmp_path: Path):  # noqa: ANN201
    manifest = publish_steps(tmp_path, operator(), [3])[3]
    return tmp_path / "origin", manifest


async def test_a_version_withdrawn_by_its_server_is_a_plain_failure_not_a_lie(origin, tmp_path: Path) -> None:
    # The peer signed that it holds every shard, then dropped the version (its fetch failed, or it pruned it)
    # and answers what server.py answers then: 404 {"error": "no such version"}, for shards and availability.
    store_dir, manifest = origin
    every = frozenset(range(len(manifest.body.shards)))
    async with (
        hostile(store_dir, 3, "withdrawn", availability=sign_availability(PEER, manifest, every)) as peer,
        hostile(store_dir, 3, chunk_delay_s=0.01) as honest,
    ):
        result = await Fetcher(
            [honest.url, peer.url],
            operator().node_id,
            Store(tmp_path / "out"),
            SETTINGS,
            peers={peer.url: frozenset({PEER.node_id})},
        ).fetch(3)
    report = {s["url"]: s for s in result.sources}
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    assert peer.withdrawn and report[peer.url]["shards_failed"] == 1
    assert report[peer.url]["lies"] == 0 and report[peer.url]["shards_corrupt"] == 0
    assert report[peer.url]["excluded"] is None  # an honest peer stays a source for later shards
    # Its claims were void from its first answer on: not asked for another shard.
    assert sum(peer.requests.values()) == 1, peer.requests


async def test_the_servers_own_answer_for_a_version_it_does_not_serve_reads_as_withdrawn(origin) -> None:
    store_dir, manifest = origin
    entry = manifest.body.shards[0]
    pool = ConnectionPool(1.0, 2.0)

    def get(path: str) -> None:
        download_shard(
            pool,
            server.url,
            path,
            size=entry.size,
            sha256=entry.sha256,
            start=0,
            hasher=hashlib.sha256(),
            sink=lambda _offset, _data: None,
            watch=Watch(deadline_s=5.0),
            cancelled=threading.Event(),
            chunk_bytes=1 << 16,
        )

    async with serving(store_dir) as server:
        try:
            with pytest.raises(ShardFailure) as gone:
                await asyncio.to_thread(get, "/v1/weights/4/shards/0")  # server.py: "no such version"
            with pytest.raises(ShardFailure) as unknown:
                await asyncio.to_thread(get, f"/v1/weights/3/shards/{len(manifest.body.shards)}")
        finally:
            pool.close()
    assert gone.value.withdrawn and gone.value.status == 404 and not gone.value.corrupt
    assert not unknown.value.withdrawn and unknown.value.status == 404  # "no such shard": not the version


async def test_a_404_that_is_not_about_the_version_is_still_a_lie(origin, tmp_path: Path) -> None:
    # Only the exact version-level answer is excused; "no such shard" for a shard it signed it holds is a lie.
    store_dir, manifest = origin
    every = frozenset(range(len(manifest.body.shards)))
    async with (
        hostile(store_dir, 3, "404", availability=sign_availability(PEER, manifest, every)) as peer,
        hostile(store_dir, 3, chunk_delay_s=0.01) as honest,
    ):
        result = await Fetcher(
            [honest.url, peer.url],
            operator().node_id,
            Store(tmp_path / "out"),
            SETTINGS,
            peers={peer.url: frozenset({PEER.node_id})},
        ).fetch(3)
    report = {s["url"]: s for s in result.sources}
    assert report[peer.url]["lies"] >= 1 and report[peer.url]["shards_corrupt"] >= 1


async def _fetch_with_sybils(
    tmp_path: Path, store_dir: Path, sybil_fault: str, origin_fault: str, settings: FetchSettings
) -> tuple[HostileSource, list[HostileSource], dict]:
    """Three advertised peers that each claim shard 0 and answer `sybil_fault` for it; an origin that answers
    its first request for shard 0 with `origin_fault` and then serves it."""
    manifest = Store(store_dir).load_manifest(3, None)
    async with contextlib.AsyncExitStack() as stack:
        sybils = [
            await stack.enter_async_context(
                hostile(store_dir, 3, sybil_fault, availability=sign_availability(key, manifest, {0}))
            )
            for key in SYBILS
        ]
        source = await stack.enter_async_context(
            hostile(store_dir, 3, origin_fault, shards={0}, fault_limit=1, availability_delay_s=ORIGIN_LATE_S)
        )
        fetcher = Fetcher(
            [source.url, *(s.url for s in sybils)],
            operator().node_id,
            Store(tmp_path / "out"),
            settings,
            peers={s.url: frozenset({key.node_id}) for s, key in zip(sybils, SYBILS, strict=True)},
        )
        result = await asyncio.wait_for(fetcher.fetch(3), 60)
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    return source, sybils, {s["url"]: s for s in result.sources}


async def test_peers_that_claim_a_shard_and_fail_it_cannot_use_up_the_origins_attempts(
    origin, tmp_path: Path
) -> None:
    # Before: the three lies and the origin's one transient failure made four failures of shard 0, over the
    # shard's budget of 2 with every source tried, and the fetch ended although the origin serves it.
    store_dir, _ = origin
    settings = SETTINGS.model_copy(update={"max_attempts_per_shard": 2})
    source, sybils, report = await _fetch_with_sybils(tmp_path, store_dir, "404", "die", settings)
    assert source.requests[0] == 2 and report[source.url]["shards_failed"] == 1
    for sybil in sybils:  # each lied about shard 0 (all three do, long before the origin is known), once
        assert sybil.requests[0] <= 1 and report[sybil.url]["lies"] == sybil.requests[0]


async def test_peers_answering_busy_cannot_use_up_the_origins_not_ready_allowance(
    origin, tmp_path: Path
) -> None:
    # Before: the sybils' busy answers used up the shard's two tolerated 503s, so the origin's one genuine busy
    # answer was charged as a failure, over the budget of 1 with every source tried, and the fetch ended.
    # The origin's busy answers are tolerated without limit (paced instead); the sybils' (advertised peers)
    # count against their own allowance, so they cost nobody else anything.
    store_dir, _ = origin
    settings = SETTINGS.model_copy(update={"max_attempts_per_shard": 1, "max_not_ready": 2})
    source, sybils, report = await _fetch_with_sybils(tmp_path, store_dir, "busy", "busy", settings)
    assert source.requests[0] == 2 and report[source.url]["shards_failed"] == 0
    assert report[source.url]["not_ready"] == 1
    for sybil in sybils:  # two busy answers each are tolerated, a third is its own failure, and it is done
        asked = sybil.requests[0]
        assert 1 <= asked <= 3 and report[sybil.url]["shards_failed"] == max(0, asked - 2)
        assert report[sybil.url]["not_ready"] == min(asked, 2) and report[sybil.url]["success"] < 1.0


def test_busy_answers_never_use_up_max_not_ready_and_plain_not_ready_ones_do() -> None:
    # An honest origin whose upload slots are all taken answers busy with Retry-After 0.2 s: 1000 of them
    # (`max_not_ready`) are 200 s, which an origin feeding a swarm can be busy for. Before, the answers past
    # the allowance were charged as failures, and the fetch of a shard only it held failed. Busy answers are
    # paced instead (they pause the source and lower its health); "not verified yet" keeps its allowance.
    now = [100.0]
    pool = SourcePool(["http://origin:1", "http://relay:1"], clock=lambda: now[0])
    origin, relay = pool.sources["http://origin:1"], pool.sources["http://relay:1"]
    settings = SETTINGS.model_copy(update={"max_not_ready": 3})
    outcomes = Outcomes(pool, settings, 3, 10)
    watch = Watch(deadline_s=60.0)
    busy = [
        outcomes.not_ready(Attempt(0, origin, 1 << 20, 0, watch), "busy", 0.2, busy=True) for _ in range(10)
    ]
    assert busy == [True] * 10  # all tolerated, past max_not_ready
    assert origin.not_ready == 10 and origin.shards_failed == origin.failures_in_row == 0
    assert (
        origin.cooldown_until == pytest.approx(now[0] + 0.2) and origin.success < 1.0
    )  # paced, less healthy
    assert origin.cooldown_until - now[0] <= NOT_READY_PAUSE_S
    plain = [
        outcomes.not_ready(Attempt(0, relay, 1 << 20, 0, watch), "not verified yet", 0.0) for _ in range(4)
    ]
    # An advertised peer answering busy for ever: counted, so the fetch is not kept waiting on it for ever.
    peer = pool.sources.setdefault("http://peer:1", SourceState("http://peer:1"))
    peer.claimants = frozenset({"a" * 64})
    peer_busy = [
        outcomes.not_ready(Attempt(0, peer, 1 << 20, 0, watch), "busy", 0.2, busy=True) for _ in range(4)
    ]
    assert peer_busy == [True, True, True, False]
    assert plain == [True, True, True, False]  # the fourth is past the allowance: the caller charges it
    assert relay.not_ready == 3


async def test_a_shard_is_given_up_once_every_source_spent_its_own_budget(origin, tmp_path: Path) -> None:
    # Per-source budgets still end a hopeless fetch: two sources that always send wrong bytes for shard 0 are
    # each asked for it max_attempts_per_shard times, and then the fetch fails naming both.
    store_dir, _ = origin
    settings = SETTINGS.model_copy(update={"max_attempts_per_shard": 2})
    async with (
        hostile(store_dir, 3, "short", shards={0}) as first,
        hostile(store_dir, 3, "short", shards={0}) as second,
    ):
        fetcher = Fetcher([first.url, second.url], operator().node_id, Store(tmp_path / "out"), settings)
        with pytest.raises(FetchError, match="shard 0 of step 3 could not be fetched") as failed:
            await asyncio.wait_for(fetcher.fetch(3), 60)
    assert first.requests[0] == second.requests[0] == 2
    assert {b["source"] for b in failed.value.blame if b["shard"] == 0} == {first.url, second.url}
