"""Serving shards as they verify, signed availability records (and peers that lie in them), rarest first.

A node fetching a version serves each shard once it verified and refuses the others; it signs which shards it
holds; fetchers ask it only for those; a source whose record claims a shard it then does not serve, or whose
record does not verify, is demoted while the fetch still completes from honest sources.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from pathlib import Path

import aiohttp
import pytest

from prime_node.p2p.identity import Identity
from prime_node.p2p.signing import canonical_json
from prime_node.p2p.weights.availability import (
    MAX_AVAILABILITY_BYTES,
    AvailabilityError,
    StaleAvailability,
    encode_bitmap,
    parse_availability,
    sign_availability,
)
from prime_node.p2p.weights.errors import FetchError
from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
from prime_node.p2p.weights.rarest import ShardQueue
from prime_node.p2p.weights.serve_verified import ServeAsVerified
from prime_node.p2p.weights.server import ServeSettings, WeightsServer
from prime_node.p2p.weights.sources import (
    NOT_READY_BACKOFF_MAX_S,
    NOT_READY_FLOOR_S,
    NOT_READY_FREE_IN_ROW,
    NOT_READY_PAUSE_S,
    SelectionSettings,
    SourcePool,
)
from prime_node.p2p.weights.store import Store

from support.weights import hostile, operator, publish_steps, same_tree, serving

SETTINGS = FetchSettings(
    stall_timeout_s=5.0,
    connect_timeout_s=1.0,
    manifest_timeout_s=2.0,
    durable=False,
    availability_interval_s=0.05,
    selection=SelectionSettings(backoff_base_s=0.02, backoff_max_s=0.2),
)
PEER = Identity.from_seed(b"\x05" * 32)


async def get(url: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.read()


async def until(check, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s")
        await asyncio.sleep(0.02)


@pytest.fixture
def origin(tmp_path: Path):  # noqa: ANN201
    manifest = publish_steps(tmp_path, operator(), [3])[3]
    return tmp_path / "origin", manifest


async def test_a_partially_fetched_node_serves_its_verified_shards_and_refuses_the_others(
    origin, tmp_path: Path
) -> None:
    store_dir, manifest = origin
    count = len(manifest.body.shards)
    first = set(range(8))
    # The upstream sends shards 0-7 and has not verified the rest (503), so the node is caught half-way.
    async with hostile(store_dir, 3, "503", shards=set(range(8, count))) as upstream:
        server = WeightsServer(
            Store(tmp_path / "node"), ServeSettings(port=0), operator().node_id, identity=PEER
        )
        url = await server.start()
        hooks = ServeAsVerified(server)
        fetcher = Fetcher([upstream.url], operator().node_id, server.store, SETTINGS, on_shard=hooks.on_shard)
        fetcher.on_manifest = hooks.on_manifest
        fetch = asyncio.create_task(fetcher.fetch(3))
        try:
            await until(lambda: 3 in server.versions and server.versions[3].ready >= first)
            assert server.versions[3].ready == first and not server.versions[3].complete
            origin_store = Store(store_dir)
            for index in sorted(first):
                status, body = await get(f"{url}/v1/weights/3/shards/{index}")
                segs = manifest.segments(index)
                expected = b"".join(
                    (origin_store.checkpoint_dir(3) / manifest.body.files[s.file_index].path).read_bytes()[
                        s.file_offset : s.file_offset + s.length
                    ]
                    for s in segs
                )
                assert status == 200 and body == expected
            began = time.monotonic()
            status, _ = await get(f"{url}/v1/weights/3/shards/8")
            assert status == 503 and time.monotonic() - began < 1.0  # refused at once: its record says so
            status, raw = await get(f"{url}/v1/weights/3/availability")
            record, have = parse_availability(raw, manifest, signers={PEER.node_id})
            assert status == 200 and have == first and record.shard_count == count
            # A long poll for more than 8 shards ends at its deadline with the same claim, never a larger one.
            status, raw = await get(f"{url}/v1/weights/3/availability?after=8")
            assert status == 200 and parse_availability(raw, manifest)[1] == first
            assert (await get(f"{url}/v1/weights/3/availability?after=%D9%A1"))[0] == 400
        finally:
            fetch.cancel()
            await asyncio.gather(fetch, return_exceptions=True)
            hooks.abandoned()
            assert 3 not in server.versions  # a fetch that did not finish is withdrawn
            await server.stop()


async def test_fetchers_ask_a_peer_only_for_what_it_claims_and_finish_from_the_origin(
    origin, tmp_path: Path
) -> None:
    store_dir, manifest = origin
    count = len(manifest.body.shards)
    held = set(range(0, count, 3))
    peer_store = Store(tmp_path / "peer")
    async with (
        hostile(store_dir, 3, "503", shards=set(range(count)) - held) as upstream,
        serving(store_dir) as honest,
    ):
        peer = WeightsServer(peer_store, ServeSettings(port=0), operator().node_id, identity=PEER)
        peer_url = await peer.start()
        hooks = ServeAsVerified(peer)
        feeder = Fetcher([upstream.url], operator().node_id, peer_store, SETTINGS, on_shard=hooks.on_shard)
        feeder.on_manifest = hooks.on_manifest
        feeding = asyncio.create_task(feeder.fetch(3))
        try:
            await until(lambda: 3 in peer.versions and peer.versions[3].ready >= held)
            result = await Fetcher(
                [peer_url, honest.url], operator().node_id, Store(tmp_path / "out"), SETTINGS
            ).fetch(3)
        finally:
            feeding.cancel()
            await asyncio.gather(feeding, return_exceptions=True)
            await peer.stop()
    report = {s["url"]: s for s in result.sources}
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    assert report[peer_url]["not_ready"] == 0 and report[peer_url]["lies"] == 0  # never asked blind
    assert report[peer_url]["shards_failed"] == 0 and report[honest.url]["shards_ok"] > 0


@pytest.mark.parametrize("record", ["claims-all", "forged", "other-manifest"])
async def test_a_source_that_lies_about_availability_is_demoted_and_the_fetch_completes(
    origin, tmp_path: Path, record: str
) -> None:
    store_dir, manifest = origin
    count = len(manifest.body.shards)
    raw = sign_availability(PEER, manifest, frozenset(range(count)))
    if record == "forged":  # claims every shard under someone else's node id
        doc = json.loads(raw)
        doc["body"]["node_id"] = operator(11).node_id
        raw = canonical_json(doc)
    elif record == "other-manifest":
        other = publish_steps(tmp_path / "other", operator(), [4])[4]
        raw = sign_availability(PEER, other, frozenset(range(len(other.body.shards))))
    async with (
        hostile(store_dir, 3, "503", availability=raw) as liar,
        serving(store_dir) as honest,
    ):
        result = await Fetcher(
            [liar.url, honest.url], operator().node_id, Store(tmp_path / "out"), SETTINGS
        ).fetch(3)
    report = {s["url"]: s for s in result.sources}
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    assert report[liar.url]["lies"] >= 1 and report[liar.url]["shards_ok"] == 0
    if record == "claims-all":  # one lie demotes it: it is asked for far fewer shards than it claims
        assert sum(liar.requests.values()) <= count // 3 and report[liar.url]["success"] < 0.5
    else:  # a record that does not verify claims nothing: the source is never asked for a shard
        assert sum(liar.requests.values()) == 0


@pytest.mark.parametrize(("fault", "lie"), [("404", True), ("busy", False)])
async def test_a_claimed_shard_answered_404_is_a_lie_and_a_busy_503_is_not(
    origin, tmp_path: Path, fault: str, lie: bool
) -> None:
    # The fetcher reads the answer's HTTP status (and the busy header), never its text: 404 denies holding a
    # shard the record claims; a busy 503 says it is held and every upload slot is taken.
    store_dir, manifest = origin
    raw = sign_availability(PEER, manifest, frozenset(range(len(manifest.body.shards))))
    async with (
        hostile(store_dir, 3, fault, availability=raw) as claimer,
        hostile(store_dir, 3, chunk_delay_s=0.01) as honest,
    ):
        result = await Fetcher(
            [claimer.url, honest.url], operator().node_id, Store(tmp_path / "out"), SETTINGS
        ).fetch(3)
    report = {s["url"]: s for s in result.sources}
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    assert sum(claimer.requests.values()) >= 1
    if lie:
        assert report[claimer.url]["lies"] >= 1 and report[claimer.url]["shards_corrupt"] >= 1
    else:
        assert report[claimer.url]["lies"] == 0 and report[claimer.url]["not_ready"] >= 1
        assert report[claimer.url]["shards_corrupt"] == 0 and report[claimer.url]["shards_failed"] == 0


@pytest.mark.parametrize("advertiser", ["impostor", "stale", "future", "unsigned"])
async def test_an_advertised_peer_is_used_only_on_a_current_record_signed_by_its_own_node_id(
    origin, tmp_path: Path, advertiser: str
) -> None:
    # The swarm named PEER's node id for this URL. What answers there signs with another valid key (a host
    # answering for someone else's URL), or with PEER's key long ago (a replay, or a clock far behind), or
    # beyond the skew in the future, or signs nothing: in each case it is never asked for a shard (it would
    # serve every one correctly), and the fetch completes from the origin.
    store_dir, manifest = origin
    every = frozenset(range(len(manifest.body.shards)))
    record = {
        "impostor": sign_availability(operator(12), manifest, every),
        "stale": sign_availability(PEER, manifest, every, now=time.time() - 400),
        "future": sign_availability(PEER, manifest, every, now=time.time() + 400),
        "unsigned": None,
    }[advertiser]
    async with (
        hostile(store_dir, 3, availability=record) as advertised,
        hostile(store_dir, 3, chunk_delay_s=0.01) as honest,
    ):
        result = await Fetcher(
            [honest.url, advertised.url],
            operator().node_id,
            Store(tmp_path / "out"),
            SETTINGS,
            peers={advertised.url: frozenset({PEER.node_id})},
        ).fetch(3)
    report = {s["url"]: s for s in result.sources}
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    assert sum(advertised.requests.values()) == 0, advertised.requests
    assert report[advertised.url]["node_id"] == PEER.node_id and report[advertised.url]["shards_ok"] == 0
    # A record that does not verify, or dated in the future, is charged as a lie. A stale one is what a node
    # whose clock runs behind signs: not taken (no replay revives old claims), not charged, asked again. A
    # peer that signs nothing is simply not used.
    assert report[advertised.url]["lies"] == (1 if advertiser in ("impostor", "future") else 0)
    assert report[advertised.url]["shards_corrupt"] == report[advertised.url]["lies"]
    if advertiser == "stale":
        assert advertised.availability_requests >= 2  # asked again after the stale answer


async def test_a_peer_whose_clock_was_behind_is_used_once_it_signs_a_current_record(
    origin, tmp_path: Path
) -> None:
    store_dir, manifest = origin
    every = frozenset(range(len(manifest.body.shards)))
    stale = sign_availability(PEER, manifest, every, now=time.time() - 400)
    async with (
        hostile(store_dir, 3, availability=stale) as peer,
        hostile(store_dir, 3, chunk_delay_s=0.05) as honest,
    ):
        fetcher = Fetcher(
            [honest.url, peer.url],
            operator().node_id,
            Store(tmp_path / "out"),
            SETTINGS,
            peers={peer.url: frozenset({PEER.node_id})},
        )
        fetch = asyncio.create_task(fetcher.fetch(3))
        await until(lambda: peer.availability_requests >= 2)
        assert sum(peer.requests.values()) == 0  # nothing taken from a stale record
        peer.availability = sign_availability(PEER, manifest, every)  # its clock fixed
        result = await asyncio.wait_for(fetch, 60)
    report = {s["url"]: s for s in result.sources}
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    assert report[peer.url]["shards_ok"] >= 1 and report[peer.url]["lies"] == 0


async def test_an_advertised_peer_that_sends_wrong_bytes_is_dropped_and_charged(
    origin, tmp_path: Path
) -> None:
    store_dir, manifest = origin
    record = sign_availability(PEER, manifest, frozenset(range(len(manifest.body.shards))))
    async with (
        hostile(store_dir, 3, "flip", availability=record) as flipper,
        hostile(store_dir, 3, chunk_delay_s=0.01) as honest,
    ):
        result = await Fetcher(
            [honest.url, flipper.url],
            operator().node_id,
            Store(tmp_path / "out"),
            SETTINGS,
            peers={flipper.url: frozenset({PEER.node_id})},
        ).fetch(3)
    report = {s["url"]: s for s in result.sources}
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    # One shard of wrong bytes, and it is out: never asked again although it still claims every shard.
    assert sum(flipper.requests.values()) == 1 and report[flipper.url]["shards_corrupt"] == 1
    assert "not matching the signed manifest; dropped" in (report[flipper.url]["excluded"] or "")


def _doc(raw: bytes) -> dict:
    return json.loads(raw)


def _resign(body: dict, key: Identity = PEER) -> bytes:
    return canonical_json({"body": body, "signature": key.sign_document(body).hex()})


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda raw: raw + b" " * MAX_AVAILABILITY_BYTES, "over the"),
        (lambda raw: b"[1, 2]", "exactly the keys"),
        (lambda raw: raw.replace(b'"body":', b'"body":{},"body":', 1), "duplicate JSON key"),
        (lambda raw: raw.replace(b'"step":3', b'"step":NaN'), "not valid JSON|NaN"),
        (lambda raw: raw.replace(b'"step":3', b'"step":4'), "signature does not verify"),
        (lambda raw: _resign({**_doc(raw)["body"], "step": "3"}), "invalid"),
        (lambda raw: _resign({**_doc(raw)["body"], "extra": 1}), "invalid"),
        (lambda raw: _resign({**_doc(raw)["body"], "shard_count": 2}), "counts 2 shards"),
        (lambda raw: _resign({**_doc(raw)["body"], "have": "!!"}), "not base64"),
        (
            lambda raw: _resign({**_doc(raw)["body"], "have": base64.b64encode(b"\xff" * 9999).decode()}),
            "bytes, not",
        ),
        (lambda raw: _resign({**_doc(raw)["body"], "issued_at_ms": 1000}), "signed .* s ago"),
        (lambda raw: _resign({**_doc(raw)["body"], "issued_at_ms": 10**15}), "in the future, beyond"),
    ],
)
def test_hostile_availability_records_are_refused_with_a_reason(origin, mutate, error: str) -> None:  # noqa: ANN001
    _, manifest = origin
    raw = sign_availability(PEER, manifest, frozenset({0, 2}))
    assert parse_availability(raw, manifest, signers={PEER.node_id})[1] == {0, 2}
    with pytest.raises(AvailabilityError, match=error):
        parse_availability(mutate(raw), manifest)
    with pytest.raises(AvailabilityError, match="not by"):
        parse_availability(raw, manifest, signers={operator().node_id})
    # Any of the node ids a source may be will do (a server that several heartbeats name: peering.py).
    record, _ = parse_availability(raw, manifest, signers={operator().node_id, PEER.node_id})
    assert record.node_id == PEER.node_id
    with pytest.raises(AvailabilityError, match="not by .* or .* or .* or 1 more"):
        parse_availability(raw, manifest, signers={operator(20 + i).node_id for i in range(4)})


def test_only_a_stale_record_is_excused_and_only_a_future_one_beyond_the_skew_is_charged(origin) -> None:  # noqa: ANN001
    _, manifest = origin
    now = time.time()
    for skew in (-290, 0, 290):  # within the tolerated skew either way: taken
        raw = sign_availability(PEER, manifest, frozenset({1}), now=now + skew)
        assert parse_availability(raw, manifest, signers={PEER.node_id}, now=now)[1] == {1}
    with pytest.raises(StaleAvailability, match="ago") as stale:
        parse_availability(
            sign_availability(PEER, manifest, frozenset({1}), now=now - 400), manifest, now=now
        )
    assert not stale.value.corrupt
    with pytest.raises(AvailabilityError, match="future") as future:
        parse_availability(
            sign_availability(PEER, manifest, frozenset({1}), now=now + 400), manifest, now=now
        )
    assert future.value.corrupt and not isinstance(future.value, StaleAvailability)
    # The signature is still checked first: an edited stale record is a forgery, not an excused one.
    edited = _doc(sign_availability(PEER, manifest, frozenset({1}), now=now - 400))
    edited["body"]["issued_at_ms"] = int(now * 1000) - 500_000
    with pytest.raises(AvailabilityError, match="signature does not verify") as forged:
        parse_availability(canonical_json(edited), manifest, now=now)
    assert forged.value.corrupt


def test_bitmaps_are_exact_canonical_and_zero_padded() -> None:
    from prime_node.p2p.weights.availability import decode_bitmap

    for count in (1, 7, 8, 9, 100):
        held = frozenset(random.Random(count).sample(range(count), count // 2))
        assert decode_bitmap(encode_bitmap(held, count), count) == held
    with pytest.raises(AvailabilityError, match="past the last shard"):
        decode_bitmap(base64.b64encode(b"\x01").decode(), 7)  # bit of a shard 7 that does not exist
    with pytest.raises(AvailabilityError, match="canonical"):
        decode_bitmap("AB==", 8)  # decodes to one zero byte, but "AA==" is its only canonical form


def test_the_rarest_shard_goes_first_and_equally_rare_ones_in_a_random_order() -> None:
    queue = ShardQueue(range(6), 6, random.Random(1))
    queue.claims_changed(None, frozenset({0, 1, 2, 3}))  # two peers hold 0-3 and 0-1; nobody holds 4, 5
    queue.claims_changed(None, frozenset({0, 1}))
    order = list(queue.candidates())
    assert set(order[:2]) == {4, 5} and set(order[2:4]) == {2, 3} and set(order[4:]) == {0, 1}
    queue.take(4)
    queue.put_back(4)  # a shard put back after a failure goes first
    assert next(queue.candidates()) == 4
    # Nodes that start together spread over different shards: the tie-break is random per fetch.
    firsts = {next(ShardQueue(range(64), 64, random.Random(seed)).candidates()) for seed in range(20)}
    assert len(firsts) > 10


async def test_a_busy_source_is_not_charged_and_the_fetch_completes(origin, tmp_path: Path) -> None:
    store_dir, _ = origin
    async with hostile(store_dir, 3, "busy") as busy, hostile(store_dir, 3, chunk_delay_s=0.01) as honest:
        result = await Fetcher(
            [busy.url, honest.url], operator().node_id, Store(tmp_path / "out"), SETTINGS
        ).fetch(3)
    report = {s["url"]: s for s in result.sources}
    assert same_tree(result.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    assert report[busy.url]["not_ready"] >= 1 and report[busy.url]["shards_failed"] == 0
    assert report[busy.url]["lies"] == 0 and report[busy.url]["shards_corrupt"] == 0
    # Not charged, but not free either: each busy answer lowers its health, so it is drawn less often.
    assert report[busy.url]["success"] < report[honest.url]["success"]


def test_a_busy_503_pauses_its_source_and_a_not_ready_one_does_not() -> None:
    now = [100.0]
    pool = SourcePool(["http://a:1", "http://b:1"], rng=random.Random(0), clock=lambda: now[0])
    busy, relay = pool.sources["http://a:1"], pool.sources["http://b:1"]
    pool.record_not_ready(busy, 5.0)  # no free upload slot: paused, at most NOT_READY_PAUSE_S
    pool.record_not_ready(relay)  # that shard is not there yet: other shards may be asked of it at once
    assert pool.weight(busy, now[0]) == 0 and pool.weight(relay, now[0]) > 0
    assert pool.pick()[0] is relay
    now[0] += NOT_READY_PAUSE_S
    assert pool.weight(busy, now[0]) > 0 and busy.failures_in_row == relay.failures_in_row == 0
    assert busy.shards_failed == relay.shards_failed == 0  # neither is charged


def test_not_ready_answers_in_a_row_pause_their_source_more_and_more_until_it_serves() -> None:
    # A source answering "not verified yet, Retry-After: 0" for every shard used to be asked again at once,
    # for the whole fetch. Its first NOT_READY_FREE_IN_ROW such answers in a row are free as before (a relay
    # behind the fetcher gives a few), then each pauses it: NOT_READY_FLOOR_S, doubled per answer, at most
    # NOT_READY_BACKOFF_MAX_S (an honest busy server's Retry-After). A verified shard from it starts the count
    # again.
    now = [100.0]
    pool = SourcePool(["http://a:1"], rng=random.Random(0), clock=lambda: now[0])
    relay = pool.sources["http://a:1"]

    def pause_after_one_more(retry_after: float = 0.0, *, counted: bool = True) -> float:
        pool.record_not_ready(relay, retry_after, counted=counted)
        pause = max(0.0, relay.cooldown_until - now[0])
        now[0] += pause  # asked again as soon as it may be
        return pause

    assert [pause_after_one_more() for _ in range(NOT_READY_FREE_IN_ROW)] == [0.0] * NOT_READY_FREE_IN_ROW
    ramp = [pause_after_one_more() for _ in range(6)]
    floor = NOT_READY_FLOOR_S
    assert NOT_READY_BACKOFF_MAX_S == 4 * floor  # the ramp reaches the cap at its third step
    assert ramp == pytest.approx([floor, 2 * floor] + [NOT_READY_BACKOFF_MAX_S] * 4)
    for _ in range(100):  # however long it goes on: no longer than the cap, and no overflow
        assert pause_after_one_more() == pytest.approx(NOT_READY_BACKOFF_MAX_S)
    # A longer Retry-After of its own is honoured past the cap, up to NOT_READY_PAUSE_S as for any busy answer.
    assert pause_after_one_more(5.0) == pytest.approx(NOT_READY_PAUSE_S)
    # A super-seeding hint within its budget (followed at once) and the answer to a blind ask (a shard it never
    # said it holds) are neither paused nor counted.
    assert pause_after_one_more(counted=False) == 0.0
    assert (
        relay.not_ready_in_row == NOT_READY_FREE_IN_ROW + 107
        and relay.not_ready == NOT_READY_FREE_IN_ROW + 108
    )
    assert relay.failures_in_row == relay.shards_failed == 0  # paused, never charged
    pool.record_success(relay, 1 << 20, 0.1)  # it served a shard: free again, a busy Retry-After honoured
    assert pause_after_one_more() == 0.0 and pause_after_one_more(0.2) == pytest.approx(0.2)


def test_a_source_that_is_always_busy_is_drawn_less_often_and_heals_with_time() -> None:
    now = [100.0]
    pool = SourcePool(["http://a:1", "http://b:1"], rng=random.Random(0), clock=lambda: now[0])
    busy, serving_one = pool.sources["http://a:1"], pool.sources["http://b:1"]
    for _ in range(10):
        pool.record_not_ready(busy, 0.2)
        pool.record_success(serving_one, 1 << 20, 0.1)
        now[0] += NOT_READY_PAUSE_S  # past each pause: only its health tells them apart
    assert pool.weight(busy, now[0]) < pool.weight(serving_one, now[0]) / 5
    picks = [pool.pick()[0] for _ in range(200)]
    assert picks.count(serving_one) > 150
    now[0] += 60  # busy a minute ago says nothing about now: the health heals as after a failure
    assert pool.weight(busy, now[0]) == pytest.approx(pool.weight(serving_one, now[0]), rel=0.05)


def test_a_peer_cannot_bind_an_announced_url_and_a_shared_url_keeps_every_claimant(tmp_path: Path) -> None:
    # URLs are compared as the fetcher uses them: "http://origin:1/" is the announced "http://origin:1", which
    # stays an announced source with no claimant; a URL that two node ids claim (spelled with or without the
    # slash) is one source with both as claimants: the server's own records say which one it is (peering.py).
    other = operator(13)
    fetcher = Fetcher(
        [
            "http://10.0.0.1:1",
            "http://10.0.0.1:1/",
            "http://10.0.0.2:1",
            "http://10.0.0.3:1/",
            "http://10.0.0.3:1",
        ],
        operator().node_id,
        Store(tmp_path / "out"),
        SETTINGS,
        peers={
            "http://10.0.0.1:1/": frozenset({PEER.node_id}),
            "http://10.0.0.3:1/": frozenset({PEER.node_id}),
            "http://10.0.0.3:1": frozenset({other.node_id}),
        },
    )
    assert fetcher.sources == ["http://10.0.0.1:1", "http://10.0.0.2:1", "http://10.0.0.3:1"]
    assert fetcher.peers == {"http://10.0.0.3:1": frozenset({PEER.node_id, other.node_id})}
    with pytest.raises(FetchError, match="has no claimant node id"):
        Fetcher(
            ["http://10.0.0.3:1"],
            operator().node_id,
            Store(tmp_path / "out"),
            SETTINGS,
            peers={"http://10.0.0.3:1": frozenset()},
        )


async def test_a_fetch_fails_when_only_a_recordless_advertised_peer_is_left(origin, tmp_path: Path) -> None:
    # Every shard from the origin is corrupt, and the advertised peer signs nothing (it may never be asked): the
    # fetch must end with the origin's failures, not wait forever for a peer it will never use.
    store_dir, _ = origin
    async with hostile(store_dir, 3, "flip") as corrupt, hostile(store_dir, 3) as unsigned:
        fetcher = Fetcher(
            [corrupt.url, unsigned.url],
            operator().node_id,
            Store(tmp_path / "out"),
            SETTINGS,
            peers={unsigned.url: frozenset({PEER.node_id})},
        )
        with pytest.raises(FetchError, match="could not be fetched and verified"):
            await asyncio.wait_for(fetcher.fetch(3), 60)
    assert sum(unsigned.requests.values()) == 0
