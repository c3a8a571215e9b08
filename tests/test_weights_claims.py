"""A weights server that several node ids name is bound to the one whose records it serves (peering.py).

Any peer can name another node's server in its heartbeat. The fetcher no longer refuses such a server (which
let anyone switch off an honest node's server for the whole swarm): the first current availability record
it serves that verifies under one of the claimants' ids binds it to that node, and the other claimants gain
nothing. The servers here are real ones on 127.0.0.1: the honest node's is the real WeightsServer signing as
its node, the others tests/support/weights.py's HostileSource.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from prime_node.p2p.identity import Identity
from prime_node.p2p.weights.availability import sign_availability
from prime_node.p2p.weights.claims import Disproved
from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
from prime_node.p2p.weights.sources import SelectionSettings
from prime_node.p2p.weights.store import Store

from support.weights import hostile, operator, publish_steps, same_tree, serving

SETTINGS = FetchSettings(
    stall_timeout_s=5.0,
    connect_timeout_s=3.0,
    manifest_timeout_s=5.0,
    durable=False,
    availability_interval_s=0.05,
    selection=SelectionSettings(backoff_base_s=0.02, backoff_max_s=0.2),
)
HONEST = Identity.from_seed(b"\x41" * 32)
LIAR = Identity.from_seed(b"\x42" * 32)


def contested_fetcher(origin_url: str, contested_url: str, tmp_path: Path) -> Fetcher:
    """A fetch from the origin and from a server both HONEST's and LIAR's heartbeats name."""
    return Fetcher(
        [origin_url, contested_url],
        operator().node_id,
        Store(tmp_path / "out"),
        SETTINGS,
        peers={contested_url: frozenset({HONEST.node_id, LIAR.node_id})},
    )


@pytest.fixture
def origin(tmp_path: Path):  # noqa: ANN201
    manifest = publish_steps(tmp_path, operator(), [3])[3]
    return tmp_path / "origin", manifest


async def until(check, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s")
        await asyncio.sleep(0.02)


async def test_a_server_another_peer_also_names_is_used_as_the_node_it_proves_to_be(
    origin, tmp_path: Path
) -> None:
    # The liar names the honest node's server too (spelled with a trailing slash: the same URL to the fetcher).
    store_dir, _ = origin
    async with (
        serving(store_dir, operator().node_id, identity=HONEST) as honest,
        hostile(store_dir, 3, chunk_delay_s=0.02) as slow_origin,
    ):
        fetcher = Fetcher(
            [slow_origin.url, honest.url, honest.url + "/"],
            operator().node_id,
            Store(tmp_path / "out"),
            SETTINGS,
            peers={honest.url: frozenset({HONEST.node_id}), honest.url + "/": frozenset({LIAR.node_id})},
        )
        result = await fetcher.fetch(3)
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    report = {s["url"]: s for s in result.sources}[honest.url]
    assert report["claimants"] == sorted([HONEST.node_id, LIAR.node_id])
    # Used, and as the honest node: its records were judged under its own id, never charged as the liar's.
    assert report["node_id"] == HONEST.node_id and report["shards_ok"] >= 1, report
    assert report["lies"] == report["shards_corrupt"] == report["shards_failed"] == 0
    assert report["excluded"] is None and fetcher.dropped_peers == {}
    assert fetcher.disproved == [Disproved(honest.url, HONEST.node_id, frozenset({LIAR.node_id}))]
    assert fetcher.proven == {honest.url: HONEST.node_id}  # drawn first by the next fetches (serving.py)


async def test_a_contested_server_signing_as_nobody_it_is_named_for_is_charged_and_never_asked(
    origin, tmp_path: Path
) -> None:
    store_dir, manifest = origin
    every = frozenset(range(len(manifest.body.shards)))
    stranger = sign_availability(operator(12), manifest, every)
    async with (
        hostile(store_dir, 3, availability=stranger) as contested,
        hostile(store_dir, 3, chunk_delay_s=0.01) as slow_origin,
    ):
        fetcher = contested_fetcher(slow_origin.url, contested.url, tmp_path)
        result = await fetcher.fetch(3)
    report = {s["url"]: s for s in result.sources}[contested.url]
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    assert sum(contested.requests.values()) == 0 and report["lies"] == 1 and report["node_id"] is None
    assert "not by" in report["last_errors"][-1] and fetcher.disproved == [] and fetcher.proven == {}


@pytest.mark.parametrize("first", ["honest", "stale"])
async def test_a_contested_server_is_bound_by_its_first_current_record_and_held_to_it(
    origin, tmp_path: Path, first: str
) -> None:
    # "honest": the server signs as the honest node (claiming shard 0 only, so the fetch goes on), then serves
    # a record of the other claimant: bound to the first, the second is a lie. "stale": its first record is the
    # honest node's from long ago (a replay, or the node that left the address): it binds nothing, and the
    # current record that follows, the other claimant's, binds the server to that one, with no lie charged.
    store_dir, manifest = origin
    every = frozenset(range(len(manifest.body.shards)))
    opening = {
        "honest": sign_availability(HONEST, manifest, frozenset({0})),
        "stale": sign_availability(HONEST, manifest, every, now=time.time() - 400),
    }[first]
    async with (
        hostile(store_dir, 3, availability=opening) as contested,
        hostile(store_dir, 3, chunk_delay_s=0.05) as slow_origin,
    ):
        fetcher = contested_fetcher(slow_origin.url, contested.url, tmp_path)
        fetch = asyncio.create_task(fetcher.fetch(3))
        await until(lambda: contested.availability_requests >= 2)  # the first answer was judged
        assert not fetch.done()
        contested.availability = sign_availability(LIAR, manifest, every)
        await until(lambda: contested.availability_requests >= 3)  # and the new one served
        result = await asyncio.wait_for(fetch, 60)
    report = {s["url"]: s for s in result.sources}[contested.url]
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    if first == "honest":
        assert report["node_id"] == HONEST.node_id and report["lies"] == 1, report
        assert f"signed by {LIAR.node_id[:16]}…, not by {HONEST.node_id[:16]}…" in " ".join(
            report["last_errors"]
        )
        assert set(contested.requests) <= {0}  # asked only for what the record that bound it claimed
        assert fetcher.disproved == [Disproved(contested.url, HONEST.node_id, frozenset({LIAR.node_id}))]
        assert fetcher.proven == {}  # a server that lied is not preferred
    else:
        assert report["node_id"] == LIAR.node_id and report["lies"] == 0, report
        assert fetcher.disproved == [Disproved(contested.url, LIAR.node_id, frozenset({HONEST.node_id}))]
        assert fetcher.proven == {contested.url: LIAR.node_id}
