"""Slow hand-offs (issue 18, class 6) between real swarm peers: drip-fed bodies are cut at the rate floor and
cooled down, one sender, one network and the newcomers each hold a bounded share of the receive slots, and an
established sender, fast or merely slow, is never kept out."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from hivemind.utils.multiaddr import Multiaddr
from pydantic import ValidationError

from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import Admitted, HandoffError, HandoffTooSlow, ReceivedRollout, RolloutEnvelope
from prime_node.p2p.swarm.framing import read_at_rate
from prime_node.p2p.swarm.slots import Claim, Cooldowns, SlotTable, network_of

from support.slow_sender import drip, signed_blob
from support.swarm import config, fleet, wait_until

FLOOR = 64 * 1024  # bytes/s
WINDOW_S = 4.0
DRIP_RATE = 32 * 1024  # half the floor, but 256 KiB in 8 s: the old per-read timeout (10 s) never fired
COOLDOWN_S = 30.0
SLOT_WAIT_S = 0.5
LIMITS = dict(
    max_concurrent_handoffs=6,
    handoff_reserved_slots=2,
    handoff_slots_per_sender=1,
    handoff_slots_per_network=3,  # newcomers of one network: 2 of them, the third kept for its established
    handoff_group_loopback=True,
    handoff_min_bytes_per_s=FLOOR,
    handoff_rate_window_s=WINDOW_S,
    handoff_deadline_grace_s=3.0,
    handoff_slot_wait_s=SLOT_WAIT_S,
    handoff_cooldown_s=COOLDOWN_S,
)


def test_a_stream_is_grouped_by_its_network() -> None:
    def net(addr: str, group_loopback: bool = False) -> str | None:
        return network_of(Multiaddr(addr), group_loopback=group_loopback)

    assert net("/ip4/203.0.113.77/tcp/4001") == net("/ip4/203.0.113.5/udp/9/quic") == "203.0.113.0/24"
    assert net("/ip4/203.0.114.77/tcp/4001") == "203.0.114.0/24"
    assert net("/ip6/2001:db8:aa:1::5/tcp/1") == net("/ip6/2001:db8:aa:ffff::9/tcp/1") == "2001:db8:aa::/48"
    assert net("/ip4/127.0.0.1/tcp/5") is None and net("/ip6/::1/tcp/5") is None  # this host: a devnet
    assert net("/ip4/127.0.0.1/tcp/5", group_loopback=True) == "127.0.0.0/24"
    # A relayed stream arrives from its relay: every node behind that relay shares the relay's network.
    relay = "12D3KooWDHA3Vs22nL7V6YuX4M5kRhYkBccvs1fcuTowmsdmr297"
    relayed = f"/ip4/198.51.100.9/tcp/4001/p2p/{relay}/p2p-circuit"
    assert net(relayed) == "198.51.100.0/24"
    assert network_of(None, group_loopback=False) == "unknown"  # no address: one shared network, no free pass


async def _fed(pieces: list[bytes], every_s: float, then_close: bool = False) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()

    async def feed() -> None:
        for piece in pieces:
            reader.feed_data(piece)
            await asyncio.sleep(every_s)
        if then_close:
            reader.feed_eof()

    asyncio.get_running_loop().create_task(feed())
    return reader


async def test_a_body_is_read_only_at_the_floor_and_within_its_deadline() -> None:
    limits = dict(chunk=4096, min_bytes_per_s=10_000, window_s=0.5)  # 5,000 bytes per half second
    fast = await _fed([b"x" * 4000] * 5, 0.1)  # 40,000 bytes/s: above the floor, across several windows
    assert len(await read_at_rate(fast, 20_000, deadline_s=5.0, **limits)) == 20_000
    trickle = await _fed([b"x" * 100] * 50, 0.1)  # 1,000 bytes/s
    start = time.monotonic()
    with pytest.raises(HandoffTooSlow, match="below the floor of 10000 bytes/s over 0.5 s"):
        await read_at_rate(trickle, 20_000, deadline_s=5.0, **limits)
    assert time.monotonic() - start < 1.0  # cut at the end of the first window, not after a per-read timeout
    # Still within its first window, but not done by the deadline (here grace 0: size / floor = 0.4 s).
    late = await _fed([b"x" * 1000] * 4, 0.2)
    with pytest.raises(HandoffTooSlow, match="the deadline for a file of this size is 0.4 s"):
        await read_at_rate(late, 4000, deadline_s=0.4, **limits)
    # A sender above the floor whose stream breaks is not cut: a plain transport failure, at no cost.
    broken = await _fed([b"x" * 4000] * 2, 0.05, then_close=True)  # 80,000 bytes/s, then the link drops
    with pytest.raises(HandoffError, match="closed the stream after 8000 of 20000 bytes") as caught:
        await read_at_rate(broken, 20_000, deadline_s=5.0, **limits)
    assert not isinstance(caught.value, HandoffTooSlow)
    # Nor one that breaks the moment after it completed a window's quota (judged since the previous window).
    quota_then_break = await _fed([b"x" * 5000], 0.0, then_close=True)
    with pytest.raises(HandoffError, match="closed the stream after 5000 of 20000") as caught:
        await read_at_rate(quota_then_break, 20_000, deadline_s=5.0, **limits)
    assert not isinstance(caught.value, HandoffTooSlow)
    # One that sends (almost) nothing and closes just before its window ends is cut, as if it had waited for it.
    idle_then_close = await _fed([b"x" * 100], 0.45, then_close=True)
    with pytest.raises(
        HandoffTooSlow, match="closed the stream after 100 of 20000 bytes, 100 of them in the"
    ):
        await read_at_rate(idle_then_close, 20_000, deadline_s=5.0, **limits)


async def test_slot_shares_per_sender_peer_network_and_tier() -> None:
    table = SlotTable(6, reserved=2, per_sender=1, per_network=3)

    def newcomer(i: int, peer: str = "", net: str | None = None) -> Claim:
        return Claim(f"n{i}", peer or f"p{i}", net, established=False)

    def established(i: int, net: str) -> Claim:
        return Claim(f"e{i}", f"q{i}", net, established=True)

    assert await table.acquire(newcomer(1, net="a"), 0) is None
    assert "this node already holds 1" in (await table.acquire(newcomer(1, peer="p9"), 0) or "")
    # One libp2p peer signing heartbeats for many node ids is still one sender.
    assert "this libp2p peer already holds 1" in (await table.acquire(newcomer(2, peer="p1"), 0) or "")
    assert await table.acquire(newcomer(2, net="a"), 0) is None
    # A network's newcomers leave the last slot of its share to its established nodes.
    refused = await table.acquire(newcomer(3, net="a"), 0) or ""
    assert "newcomer nodes of network a hold 2" in refused and "kept for its established" in refused
    for i in (3, 4):
        assert await table.acquire(newcomer(i, net=f"other{i}"), 0) is None
    # Four newcomers hold their share: the two reserved slots stay free for established nodes only.
    assert table.in_use == 4 and "newcomers hold their 4" in (await table.acquire(newcomer(5), 0) or "")
    assert await table.acquire(established(0, "a"), 0) is None  # the slot a's newcomers left
    # The network's share counts both tiers: one network never holds every slot, whatever ids it uses.
    assert "nodes of network a hold 3" in (await table.acquire(established(1, "a"), 0) or "")
    assert await table.acquire(established(1, "b"), 0) is None
    assert "all 6 receive slots are taken" in (await table.acquire(established(2, "c"), 0) or "")
    # A waiter gets the slot the moment it is released, within its wait.
    waiting = asyncio.create_task(table.acquire(established(2, "c"), 5.0))
    await asyncio.sleep(0.05)
    await table.release(established(0, "a"))
    assert await asyncio.wait_for(waiting, 5) is None and table.in_use == 6
    # A network's share must leave other networks a slot: the settings refuse one as large as the total.
    with pytest.raises(ValidationError, match="one network must never hold every receive slot"):
        config("x", Identity.generate(), max_concurrent_handoffs=4, handoff_slots_per_network=4)


def test_each_cut_doubles_the_cooldown_until_a_hand_off_completes() -> None:
    now = [0.0]
    cooldowns = Cooldowns(10.0, 25.0, clock=lambda: now[0])
    assert cooldowns.remaining("n", "p") == 0.0
    assert [cooldowns.strike("n", "p") for _ in range(3)] == [10.0, 20.0, 25.0]  # capped
    assert cooldowns.remaining("n", "other peer") == 25.0  # the node id is cooled down on any peer
    assert cooldowns.remaining("other node", "p") == 25.0  # and the peer under any node id
    now[0] += 25.0
    assert cooldowns.remaining("n", "p") == 0.0
    cooldowns.completed("n", "p")
    assert cooldowns.strike("n", "p") == 10.0  # a completed hand-off starts the count again


async def test_drip_fed_streams_are_cut_and_shared_out_while_established_files_get_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="prime_node.p2p.swarm.handoff")  # the cuts' log lines
    operator = Identity.generate()
    async with fleet("slowhandoff", operator) as group:
        validator = await group.add(operator, roles=("validator",), **LIMITS)
        await validator.publish_validator()
        received: list[ReceivedRollout] = []
        established = Identity.generate()

        async def admit(header: RolloutEnvelope) -> Admitted:  # stands in for the ledger's tiers
            return Admitted(established=header.node_id == established.node_id)

        receiver = await validator.serve_rollouts(tmp_path / "incoming", received.append, admit)
        # Three newcomer peers on this host (one network, with loopback grouped) and one established peer.
        slow = [await group.add() for _ in range(3)]
        honest = await group.add(established)
        target = validator.peer_id
        for peer in [*slow, honest]:
            await wait_until(lambda p=peer: _binds(validator, p), 20)

        def start_drip(peer, i: int) -> asyncio.Task:  # noqa: ANN001
            blob = signed_blob(peer.identity, 2 << 20)
            sending = drip(peer, target, *blob, bytes_per_s=DRIP_RATE, limit_s=40)
            return asyncio.create_task(sending, name=f"drip-{i}")

        peak = {"node": 0, "newcomers": 0, "network": 0}

        async def watch() -> None:
            while True:
                held = receiver.slots
                peak["node"] = max(peak["node"], *(held.held("node", p.node_id) for p in slow))
                peak["newcomers"] = max(peak["newcomers"], held.held("tier", "newcomer"))
                peak["network"] = max(peak["network"], held.held("net:newcomer", "127.0.0.0/24"))
                await asyncio.sleep(0.02)

        watching = asyncio.create_task(watch(), name="slot-watch")
        # The attack: four drip-fed streams from one newcomer, then one from each of two more newcomers.
        attack = [start_drip(slow[0], i) for i in range(4)]
        await wait_until(lambda: _holding(receiver, 1), 10, interval=0.02)
        attack += [start_drip(peer, 4 + i) for i, peer in enumerate(slow[1:])]
        await wait_until(lambda: _holding(receiver, 2), 10, interval=0.02)
        # In the thick of it, the established node's files go through at once, each within a bound.
        seconds = []
        for size in (300_000, 300_000):
            data, envelope = signed_blob(established, size)
            start = time.monotonic()
            await honest.send_rollout(data, envelope)  # HandoffBusy here (every slot held) fails the test
            seconds.append(time.monotonic() - start)
        assert max(seconds) < 8.0, seconds
        drips = await asyncio.wait_for(asyncio.gather(*attack), 60)
        watching.cancel()

        # Every stream that got a slot was cut at the floor, within a window (and some slack for the machine).
        went = [d for d in drips if d.went]
        assert went and all(d.held_s is not None and d.held_s < WINDOW_S + 2.5 for d in went), drips
        assert all("below the floor" in d.busy_reason() for d in went), [d.busy_reason() for d in went]
        assert all(d.sent < 2 << 20 for d in drips)
        cuts = [r.getMessage() for r in caplog.records if "cut off the hand-off" in r.getMessage()]
        assert len(cuts) == len(went) == receiver.cut_off, cuts
        # One newcomer: one slot, whatever number of streams; the others were told busy.
        assert sum(d.went for d in drips[:4]) == 1, [d.answer for d in drips[:4]]
        others = " | ".join(d.busy_reason() for d in drips[:4] if not d.went)
        assert "this node already holds 1" in others or "cooling down" in others, others
        # The three newcomers of one network held at most its newcomers' share, never all three together.
        assert peak == {"node": 1, "newcomers": 2, "network": 2}, peak
        assert sum(d.went for d in drips[4:]) == 1, [d.answer for d in drips[4:]]
        told = " | ".join(d.busy_reason() for d in drips[4:])
        assert "newcomer nodes of network 127.0.0.0/24 hold 2" in told, told
        # A cut costs the sender a cooldown before its next hand-off.
        again = await drip(slow[0], target, *signed_blob(slow[0].identity, 100_000), bytes_per_s=FLOOR * 4)
        assert not again.went and "cooling down" in again.busy_reason(), again
        assert COOLDOWN_S - 5 < again.answer["retry_after_s"] <= COOLDOWN_S

        # A sender on a slow link above the floor is never cut, and pays nothing.
        data, envelope = signed_blob(established, 900 * 1024)
        slow_link = await drip(honest, target, data, envelope, bytes_per_s=2 * FLOOR, limit_s=30)
        assert slow_link.went and "receipt" in slow_link.final, slow_link
        assert slow_link.held_s is not None and slow_link.held_s > WINDOW_S  # it spanned windows
        assert receiver.cooldowns.remaining(established.node_id, honest.peer_id) == 0.0
        assert {r.envelope.node_id for r in received} == {established.node_id} and len(received) == 3
        assert receiver.slots.in_use == 0


async def _binds(validator, peer) -> bool:  # noqa: ANN001
    return (await validator.list_peers()).get(peer.node_id) is not None


async def _holding(receiver, count: int) -> bool:  # noqa: ANN001
    return receiver.slots.in_use >= count
