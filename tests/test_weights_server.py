"""The weights server (Range, bans, rate limits, --keep) and relays (pipelined, never serving bad data)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from prime_node.p2p.identity import Identity
from prime_node.p2p.weights.access import AUTH_HEADER, TOKEN_LIFETIME_S, audience_of, make_access_token
from prime_node.p2p.weights.errors import FetchError
from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
from prime_node.p2p.weights.relay import Relay
from prime_node.p2p.weights.server import ServeSettings, WeightsServer
from prime_node.p2p.weights.sources import SelectionSettings
from prime_node.p2p.weights.store import Store

from support.weights import hostile, operator, publish_steps, same_tree, serving

FAST = FetchSettings(
    stall_timeout_s=1.0,
    connect_timeout_s=1.0,
    durable=False,
    max_attempts_per_shard=3,
    selection=SelectionSettings(backoff_base_s=0.02, backoff_max_s=0.1),
)


async def get(url: str, **headers: str) -> tuple[int, bytes, dict[str, str]]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


async def test_shards_honour_range_requests(tmp_path: Path) -> None:
    manifest = publish_steps(tmp_path, operator(), [3])[3]
    shard = tmp_path / "origin" / "step-000000000003" / "checkpoint" / "config.json"
    first = shard.read_bytes()
    async with serving(tmp_path / "origin") as server:
        base = f"{server.url}/v1/weights/3/shards/0"
        status, whole, headers = await get(base)
        assert status == 200 and len(whole) == manifest.body.shards[0].size and whole.startswith(first)
        assert headers["Content-Type"] == "application/octet-stream" and headers["Accept-Ranges"] == "bytes"
        status, part, headers = await get(base, Range="bytes=10-99")
        assert (
            status == 206
            and part == whole[10:100]
            and headers["Content-Range"] == f"bytes 10-99/{len(whole)}"
        )
        assert (await get(base, Range="bytes=100-"))[1] == whole[100:]
        assert (await get(base, Range="bytes=-5"))[1] == whole[-5:]
        assert (await get(base, Range=f"bytes={len(whole)}-"))[0] == 416
        assert (await get(f"{server.url}/v1/weights/3/shards/{len(manifest.body.shards)}"))[0] == 404
        assert (await get(f"{server.url}/v1/weights/4/manifest"))[0] == 404
        status, body, _ = await get(f"{server.url}/v1/weights/versions")
        assert status == 200 and b'"complete": true' in body and manifest.digest.encode() in body


def token_for(identity: Identity, url: str, **kwargs: float) -> dict[str, str]:
    parts = urlsplit(url)
    return {AUTH_HEADER: make_access_token(identity, audience_of(parts.hostname, parts.port), **kwargs)}


async def test_banned_clients_get_403(tmp_path: Path) -> None:
    publish_steps(tmp_path, operator(), [1], megabytes=0.1)
    async with serving(tmp_path / "origin", ban=["127.0.0.0/8"]) as server:
        assert (await get(f"{server.url}/v1/weights/latest"))[0] == 403
    banned = operator(9)
    ban_file = tmp_path / "bans.txt"
    ban_file.write_text("# banned by the operator\n")
    async with serving(tmp_path / "origin", ban_file=ban_file, scan_interval_s=0.05) as server:
        latest = f"{server.url}/v1/weights/latest"
        assert (await get(latest, **token_for(banned, server.url)))[0] == 200
        ban_file.write_text(f"{banned.node_id}  # slashed for bad rollouts\n")
        await asyncio.sleep(0.3)  # the ban file is re-read when it changes
        assert (await get(latest, **token_for(banned, server.url)))[0] == 403
        assert (await get(latest, **token_for(operator(10), server.url)))[0] == 200
        # An unproven claim of another id is not an identity: the old plain header changes nothing.
        assert (await get(latest, **{"X-Prime-Node-Id": banned.node_id}))[0] == 200


async def test_node_bans_cannot_be_dodged_by_dropping_or_forging_the_token(tmp_path: Path) -> None:
    publish_steps(tmp_path, operator(), [1], megabytes=0.1)
    banned, honest = operator(9), operator(10)
    async with serving(tmp_path / "origin", require_node_auth=True) as server:
        server.bans.set_dynamic({banned.node_id})  # as the node and trainer do from the DHT's signed bans
        latest = f"{server.url}/v1/weights/latest"
        status, body, _ = await get(latest)
        assert status == 401 and AUTH_HEADER.encode() in body
        assert (await get(latest, **token_for(banned, server.url)))[0] == 403
        assert (await get(latest, **token_for(honest, server.url)))[0] == 200
        # banned node presenting the honest node's id with its own signature: refused as forged
        forged = token_for(banned, server.url)[AUTH_HEADER].split(".")
        forged[0] = honest.node_id
        status, body, _ = await get(latest, **{AUTH_HEADER: ".".join(forged)})
        assert status == 401 and b"does not verify" in body
        # a token made for another server (replayed by a relay) is refused, also when the replay names that
        # other server in its Host header; and so is a stale token
        assert (await get(latest, **token_for(honest, "http://127.0.0.1:1")))[0] == 401
        status, body, _ = await get(latest, Host="127.0.0.1:1", **token_for(honest, "http://127.0.0.1:1"))
        assert status == 401 and b"not this server" in body
        assert (
            await get(
                latest,
                Host=f"localhost:{server.port}",
                **token_for(honest, f"http://localhost:{server.port}"),
            )
        )[0] == 200
        server.accept_audience("http://weights.example.org")  # a public name in front of it (NAT, DNS)
        # An IP spelled loosely is also accepted as peers write it (serving.py `canonical_url`: compressed).
        server.accept_audience("http://[2001:DB8:0:0::1]:8470")
        assert {"2001:db8:0:0::1:8470", "2001:db8::1:8470"} <= server.audiences
        assert (
            await get(latest, Host="weights.example.org", **token_for(honest, "http://weights.example.org"))
        )[0] == 200
        stale = token_for(honest, server.url, now=time.time() - TOKEN_LIFETIME_S - 5)
        status, body, _ = await get(latest, **stale)
        assert status == 401 and b"check the clock" in body
        assert (await get(latest, **{AUTH_HEADER: "x" * 5000}))[0] == 401
        server.bans.set_dynamic(set())  # a lifted ban
        assert (await get(latest, **token_for(banned, server.url)))[0] == 200
        # The library fetcher signs its requests: a node with a key downloads, the banned one is refused.
        server.bans.set_dynamic({banned.node_id})
        await Fetcher(
            [server.url], operator().node_id, Store(tmp_path / "honest"), FAST, identity=honest
        ).fetch()
        with pytest.raises(FetchError):
            await Fetcher(
                [server.url], operator().node_id, Store(tmp_path / "banned"), FAST, identity=banned
            ).fetch()


async def test_clients_over_their_rate_get_429(tmp_path: Path) -> None:
    publish_steps(tmp_path, operator(), [1], megabytes=0.1)
    async with serving(tmp_path / "origin", rate_per_s=0.5, rate_burst=3) as server:
        statuses = [(await get(f"{server.url}/v1/weights/latest"))[0] for _ in range(4)]
        status, _, headers = await get(f"{server.url}/v1/weights/latest")
    assert statuses == [200, 200, 200, 429] and status == 429 and float(headers["Retry-After"]) > 0


async def test_server_binds_loopback_by_default_and_keeps_only_the_newest_versions(tmp_path: Path) -> None:
    assert ServeSettings().host == "127.0.0.1"
    key = operator()
    publish_steps(tmp_path, key, [1, 2, 3, 4], megabytes=0.1)
    async with serving(tmp_path / "origin", keep=2, scan_interval_s=0.05) as server:
        assert server.addresses and all(host == "127.0.0.1" for host, _ in server.addresses)
        assert Store(tmp_path / "origin").versions() == [3, 4]
        publish_steps(tmp_path, key, [5], megabytes=0.1)  # a trainer publishes into the served directory
        await asyncio.sleep(0.4)
        assert Store(tmp_path / "origin").versions() == [4, 5]
        assert sorted(server.versions) == [4, 5]
        assert (await get(f"{server.url}/v1/weights/3/manifest"))[0] == 404
        assert b'"step":5' in (await get(f"{server.url}/v1/weights/latest"))[1]


async def test_relay_serves_shards_before_the_whole_version_has_arrived(tmp_path: Path) -> None:
    publish_steps(tmp_path, operator(), [3])
    origin = tmp_path / "origin"
    relay_server = WeightsServer(
        Store(tmp_path / "relay"),
        ServeSettings(port=0, shard_wait_s=15.0),
        operator().node_id,  # generous: CI cores are shared
    )
    relay_url = await relay_server.start()
    async with hostile(origin, 3, chunk_delay_s=0.02) as slow_upstream:
        relay = Relay(
            relay_server, [slow_upstream.url], operator().node_id, FAST.model_copy(update={"concurrency": 2})
        )
        mirroring = asyncio.create_task(relay.follow_once(), name="test-relay")
        try:
            deadline = asyncio.get_running_loop().time() + 60
            while asyncio.get_running_loop().time() < deadline:
                status, body, _ = await get(f"{relay_url}/v1/weights/versions")
                if b'"shards_ready": 0' not in body and b'"step": 3' in body:
                    break
                await asyncio.sleep(0.02)
            assert b'"complete": false' in body and not mirroring.done()  # advertised while still arriving
            client = Fetcher([relay_url], operator().node_id, Store(tmp_path / "client"), FAST)
            fetched = asyncio.create_task(client.fetch())
            await asyncio.sleep(0.3)
            assert not mirroring.done()  # the client is already being served while the relay is mirroring
            result = await fetched
            assert await mirroring == 3
        finally:
            mirroring.cancel()
            await relay_server.stop()
    assert same_tree(origin / "step-000000000003" / "checkpoint", result.checkpoint_dir)
    assert same_tree(
        origin / "step-000000000003" / "checkpoint", tmp_path / "relay" / "step-000000000003" / "checkpoint"
    )


async def test_relay_never_serves_a_version_signed_by_another_key(tmp_path: Path) -> None:
    publish_steps(tmp_path, operator(8), [3], megabytes=0.2)
    async with (
        serving(tmp_path / "origin") as upstream,
        serving(tmp_path / "relay", operator().node_id) as relay_server,
    ):
        relay = Relay(relay_server, [upstream.url], operator().node_id, FAST)
        with pytest.raises(FetchError, match="no source served a valid manifest"):
            await relay.follow_once()
        assert (await get(f"{relay_server.url}/v1/weights/latest"))[0] == 404
        assert (await get(f"{relay_server.url}/v1/weights/3/shards/0"))[0] == 404
    assert Store(tmp_path / "relay").versions() == []


async def test_relay_never_serves_a_corrupt_shard_nor_the_failed_version(tmp_path: Path) -> None:
    publish_steps(tmp_path, operator(), [3])
    async with hostile(tmp_path / "origin", 3, "flip", shards={5}, chunk_delay_s=0.01) as upstream:
        async with serving(tmp_path / "relay", operator().node_id, shard_wait_s=0.1) as relay_server:
            relay = Relay(relay_server, [upstream.url], operator().node_id, FAST)
            mirroring = asyncio.create_task(relay.follow_once())
            seen: list[int] = []
            while not mirroring.done():
                seen.append((await get(f"{relay_server.url}/v1/weights/3/shards/5"))[0])
            with pytest.raises(FetchError, match="shard 5 of step 3"):
                await mirroring
            assert seen and 200 not in seen  # asked throughout the mirroring: never served
            assert (await get(f"{relay_server.url}/v1/weights/3/shards/5"))[0] == 404
            assert (await get(f"{relay_server.url}/v1/weights/latest"))[0] == 404
    relay_store = Store(tmp_path / "relay")
    assert relay_store.versions() == []  # never in place; what verified waits under .partial/ for a rerun
    assert "5" not in json.loads((relay_store.partial_dir(3) / "progress.json").read_bytes())["done"]


async def test_a_peer_serves_the_version_it_fetched_and_verified(tmp_path: Path) -> None:
    publish_steps(tmp_path, operator(), [3], megabytes=0.5)
    async with serving(tmp_path / "origin") as origin:
        await Fetcher([origin.url], operator().node_id, Store(tmp_path / "peer"), FAST).fetch()
    # The origin is gone; the peer's own store (the same layout) is served with the same server code.
    async with serving(tmp_path / "peer", operator().node_id) as peer:
        result = await Fetcher([peer.url], operator().node_id, Store(tmp_path / "other"), FAST).fetch()
    assert same_tree(tmp_path / "origin" / "step-000000000003" / "checkpoint", result.checkpoint_dir)


def test_a_server_bound_to_every_interface_answers_to_each_local_address() -> None:
    from prime_node.p2p.weights.access import own_audiences

    names = own_audiences("0.0.0.0", [("0.0.0.0", 8470)], 8470)
    assert {"127.0.0.1:8470", "localhost:8470", "0.0.0.0:8470"} <= names
    assert own_audiences("10.1.2.3", [("10.1.2.3", 9000)], 9000) == {"10.1.2.3:9000"}
