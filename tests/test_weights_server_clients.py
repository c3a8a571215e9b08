"""Hostile clients of the weights server (issue 18 H4): what they hold is bounded, and an honest fetch goes on.

The trainer, relays and nodes with serve_weights run this server for anyone who can reach it. Each hostile
client here is tests/support/hostile_client.py in its own process, connecting from its own 127.x address:
connections that never finish a request head, that drip one, that ask for a shard and never read it, or
that reset mid-shard, and floods of connections. Beside each, an honest fetch from 127.0.0.1 must complete,
and the server must let go of every hostile connection (and the file it was sending) at its deadline.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import psutil
import pytest

from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
from prime_node.p2p.weights.guard import ServeLimits, client_of
from prime_node.p2p.weights.publish import publish
from prime_node.p2p.weights.store import Store
from prime_node.p2p.weights.transfer import BUSY_HEADER

from support.weights import hostile_clients, make_checkpoint, operator, publish_steps, same_tree, serving

HEAD_S = 0.5  # request-head deadline of the servers here
LIMITS = ServeLimits(
    header_timeout_s=HEAD_S,
    send_grace_s=0.5,
    min_send_rate_bytes_s=8 << 20,  # a 16 MiB shard must be read within 0.5 + 2 s
    max_connections_per_ip=8,
    max_connections=12,
)
FAST = FetchSettings(connect_timeout_s=2.0, stall_timeout_s=2.0, durable=False)


async def fetch(url: str, out: Path) -> Path:
    result = await asyncio.wait_for(Fetcher([url], operator().node_id, Store(out), FAST).fetch(), 30)
    return result.checkpoint_dir


def open_fds() -> int:
    return psutil.Process().num_fds()


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    publish_steps(tmp_path, operator(), [3], megabytes=0.5)
    return tmp_path / "origin"


@pytest.fixture
def big_origin(tmp_path: Path) -> Path:
    """One 16 MiB shard: more than the socket buffers hold, so a client that does not read blocks the send."""
    ckpt = make_checkpoint(tmp_path / "big", megabytes=16)
    publish(ckpt, step=3, identity=operator(), out_dir=tmp_path / "big-origin", shard_size=32 << 20)
    return tmp_path / "big-origin"


@pytest.mark.parametrize("mode", ["silent", "drip-head"])
async def test_clients_that_never_finish_a_request_head_are_cut_at_its_deadline(
    origin: Path, tmp_path: Path, mode: str
) -> None:
    async with serving(origin, limits=LIMITS) as server:
        with hostile_clients(server.url, mode, 6, source_ip="127.0.0.2") as clients:
            fetched = await fetch(server.url, tmp_path / "out")  # the honest control, meanwhile
            report = await asyncio.to_thread(clients.result, 15)
        assert server.guard.open == 0
    assert same_tree(origin / "step-000000000003" / "checkpoint", fetched)
    # Before: held until aiohttp's keep-alive timeout (an hour), a socket each.
    assert all(t is not None and t < HEAD_S + 1.5 for t in report["closed_at"]), report


async def test_a_client_that_does_not_read_its_shard_is_cut_at_the_send_deadline(
    big_origin: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    shard = "/v1/weights/3/shards/0"
    async with serving(big_origin, limits=LIMITS) as server:
        before = open_fds()
        with (
            hostile_clients(server.url, "slow-read", 4, source_ip="127.0.0.2", path=shard) as readers,
            hostile_clients(server.url, "reset", 4, source_ip="127.0.0.3", path=shard) as resetters,
        ):
            await asyncio.sleep(0.3)  # the shards are being sent: a socket and an open file each
            assert open_fds() >= before + 4
            fetched = await fetch(server.url, tmp_path / "out")
            report = await asyncio.to_thread(readers.result, 15)
            reset = await asyncio.to_thread(resetters.result, 15)
        await asyncio.sleep(0.2)
        assert server.guard.open == 0 and open_fds() <= before  # every socket and file let go
    assert same_tree(big_origin / "step-000000000003" / "checkpoint", fetched)
    deadline = LIMITS.send_deadline_s(16 << 20)
    assert all(t is not None and t < deadline + 1.5 for t in report["closed_at"]), report
    assert all(n >= 1024 for n in reset["received"]), reset
    # A client that goes away is its own business: no error, no traceback, in the server's log.
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_connections_over_the_caps_are_closed_at_once(origin: Path, tmp_path: Path) -> None:
    # The admitted connections are held until their head deadline (3 s here), the refused ones closed at once:
    # the clients watch for 1.5 s after their last connect, time enough on a loaded machine to see every
    # refusal and not yet the deadline.
    async with serving(origin, limits=LIMITS.model_copy(update={"header_timeout_s": 3.0})) as server:
        with (
            hostile_clients(server.url, "silent", 20, source_ip="127.0.0.2", duration=1.5) as first,
            hostile_clients(server.url, "silent", 20, source_ip="127.0.0.3", duration=1.5) as second,
        ):
            one = await asyncio.to_thread(first.result, 15)
            two = await asyncio.to_thread(second.result, 15)
        # Per address at most 8 are held (until their head deadline); in all at most 12.
        held = [sum(1 for t in r["closed_at"] if t is None) for r in (one, two)]
        assert held[0] <= 8 and held[1] <= 8 and sum(held) <= 12, held
        assert server.guard.refused >= 40 - 12
        # The honest control: once the flood's connections are cut, an honest client is served at once.
        fetched = await fetch(server.url, tmp_path / "out")
    assert same_tree(origin / "step-000000000003" / "checkpoint", fetched)


async def test_an_honest_fetch_beside_a_flood_from_one_address(origin: Path, tmp_path: Path) -> None:
    async with serving(origin, limits=LIMITS.model_copy(update={"max_connections": 64})) as server:
        with hostile_clients(server.url, "silent", 40, source_ip="127.0.0.2") as flood:
            fetched = await fetch(server.url, tmp_path / "out")
            assert server.guard.per_ip["127.0.0.2"] <= 8
            report = await asyncio.to_thread(flood.result, 15)
    assert same_tree(origin / "step-000000000003" / "checkpoint", fetched)
    assert all(t is not None for t in report["closed_at"]), report


async def get_from(source_ip: str, url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    """One GET to `url` from `source_ip` (any 127.x address on Linux): status, headers, body."""
    connector = aiohttp.TCPConnector(local_addr=(source_ip, 0))
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(url, headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.read()


async def test_one_client_that_does_not_read_holds_one_upload_slot_not_all(big_origin: Path) -> None:
    # Slots are held for a whole send, and a client that never reads holds one until its send deadline (a
    # 16 MiB shard at the default 64 KiB/s: about 266 s). Before the per-client cap two such connections from
    # one address took both slots, and the server answered everyone busy for minutes.
    shard = "/v1/weights/3/shards/0"
    limits = LIMITS.model_copy(update={"send_grace_s": 60.0})  # the stalled send outlives the test
    async with serving(big_origin, limits=limits, upload_slots=2) as server:
        with hostile_clients(server.url, "slow-read", 1, source_ip="127.0.0.2", path=shard, duration=30):
            for _ in range(300):  # bounded: 15 s for the stalled request to take its slot
                if server.sending == 1:
                    break
                await asyncio.sleep(0.05)
            assert server.sending_by_client == {"127.0.0.2": 1}
            # The same address asks again: busy, as if every slot were taken (one slot is still free).
            status, headers, _ = await get_from("127.0.0.2", server.url + shard, Range="bytes=0-1023")
            assert status == 503 and BUSY_HEADER in headers, (status, headers)
            assert headers["Retry-After"] == "0.2"
            # Another address is served at once from the free slot.
            status, headers, body = await get_from("127.0.0.3", server.url + shard, Range="bytes=0-1023")
            assert status == 206 and len(body) == 1024, (status, headers)
            for _ in range(
                300
            ):  # bounded: the served request's handler lets go of its slot after its last byte
                if server.sending_by_client == {"127.0.0.2": 1}:
                    break
                await asyncio.sleep(0.05)
            assert server.sending_by_client == {"127.0.0.2": 1}  # the served request let go of its slot
        for _ in range(300):  # bounded: the killed client's send breaks off and lets go of its slot
            if server.sending == 0:
                break
            await asyncio.sleep(0.05)
        assert server.sending == 0 and server.sending_by_client == {}


async def test_route_numbers_are_ascii_digits_only(origin: Path) -> None:
    async with serving(origin) as server, aiohttp.ClientSession() as session:
        for path in ("3/manifest", "%D9%A3/manifest", "3/shards/0", "3/shards/%D9%A0", "%EF%BC%93/manifest"):
            async with session.get(f"{server.url}/v1/weights/{path}") as resp:
                ascii_only = "%" not in path
                assert resp.status == (200 if ascii_only else 404), (path, resp.status)


def test_a_client_is_an_ipv4_address_or_an_ipv6_slash_64() -> None:
    # The per-client limits (connections, the request rate, upload slots) used the full address, and an IPv6
    # subscriber holds a whole /64: a client could take a server's per-client share once per address it chose.
    assert client_of("203.0.113.7") == "203.0.113.7" != client_of("203.0.113.8")
    assert (
        client_of("2001:db8:1:2::1") == client_of("2001:db8:1:2:ffff:ffff:ffff:ffff") == "2001:db8:1:2::/64"
    )
    assert client_of("2001:db8:1:3::1") != client_of("2001:db8:1:2::1")  # another subscriber
    assert client_of("::ffff:203.0.113.7") == "203.0.113.7"  # an IPv4 client on a dual-stack socket
    assert client_of(None) == client_of("") == "?"
    assert client_of("not an address") == "not an address"
