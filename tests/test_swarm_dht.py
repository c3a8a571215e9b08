"""Swarm membership with real hivemind DHT peers (child processes with p2pd) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from prime_node.p2p.identity import Identity
from prime_node.p2p.processes import child_pids, end_pids
from prime_node.p2p.signing import canonical_json
from prime_node.p2p.swarm import PolicyAnnouncement, SwarmError
from prime_node.p2p.swarm.mp_locks import SHARED_LOCKS, replace_locks_held_by_the_dead
from prime_node.p2p.swarm.process import SwarmDHT, wait_until_started
from prime_node.p2p.swarm.records import RecordKind, dht_key, seal, seal_payload

from support.swarm import LOOPBACK, RUN_PARAMETERS, fleet, local_subkeys, wait_until


@pytest.mark.slow
async def test_ten_peers_see_each_other_within_ten_seconds() -> None:
    operator = Identity.generate()
    async with fleet("ten", operator) as group:
        first = await group.add(operator, roles=("trainer",))
        for _ in range(3):  # three at a time: nine p2pd starts and pings at once time out on busy cores
            await asyncio.gather(*(group.add() for _ in range(3)))
        everyone = {p.node_id for p in group.peers}
        await first.publish_policy(5, "cd" * 32, ["http://127.0.0.1:9/"], RUN_PARAMETERS)

        async def all_see_all() -> bool:
            views = await asyncio.gather(*(p.list_peers() for p in group.peers))
            policies = await asyncio.gather(*(p.current_policy() for p in group.peers))
            return all(set(v) == everyone for v in views) and all(pol and pol.step == 5 for pol in policies)

        took = await wait_until(all_see_all, timeout=10.0)
        assert took < 10.0
        view = await group.peers[-1].list_peers()
        assert view[first.node_id].peer_id == first.peer_id and view[first.node_id].roles == ["trainer"]


async def test_forged_records_are_refused_by_every_honest_peer() -> None:
    operator = Identity.generate()
    run = "forge"
    async with fleet(run, operator) as group:
        victim = await group.add(operator)
        await asyncio.gather(*(group.add() for _ in range(3)))
        boot = await group.bootstrap()
        # The attacker runs hivemind without our validator, so it stores and serves whatever it likes.
        attacker = SwarmDHT(initial_peers=boot, start=True, host_maddrs=LOOPBACK)
        try:
            evil, schemer, timetraveller = Identity.generate(), Identity.generate(), Identity.generate()
            template = (await victim.list_peers())[victim.node_id]

            def body_of(identity: Identity):  # a well-formed heartbeat, re-signed by `identity`
                return template.model_copy(update={"node_id": identity.node_id})

            exp, far = get_dht_time() + 30, get_dht_time() + 10 * 86400
            hb, pol = RecordKind.HEARTBEAT, RecordKind.POLICY
            good_evil = seal(evil, run, hb, evil.node_id, body_of(evil), exp)
            flipped = good_evil[:40] + bytes([good_evil[40] ^ 1]) + good_evil[41:]
            policy = PolicyAnnouncement(
                step=99, manifest_sha256="ee" * 32, sources=[], published_at=1.0, run=RUN_PARAMETERS
            )
            forged = {  # name: (key kind, subkey, value, expiration)
                "bad signature": (hb, evil.node_id, flipped, exp + 5),
                "another owner's subkey": (hb, victim.node_id, good_evil, exp + 20),
                "bad schema": (
                    hb,
                    schemer.node_id,
                    seal_payload(
                        schemer, run, hb, schemer.node_id, canonical_json({"node_id": schemer.node_id}), exp
                    ),
                    exp,
                ),
                "oversized": (hb, "c" * 64, b"x" * 20_000, exp),
                "far-future expiry": (
                    hb,
                    timetraveller.node_id,
                    seal(timetraveller, run, hb, timetraveller.node_id, body_of(timetraveller), far),
                    far,
                ),
                "policy by non-operator": (
                    pol,
                    evil.node_id,
                    seal(evil, run, pol, evil.node_id, policy, exp),
                    exp,
                ),
            }
            for kind, subkey, value, when in forged.values():
                await asyncio.wait_for(
                    attacker.store(dht_key(run, kind), value, when, subkey=subkey, return_future=True), 30
                )
            # Control: a correctly signed record from the attacker is accepted, so refusals mean something.
            await asyncio.wait_for(
                attacker.store(dht_key(run, hb), good_evil, exp, subkey=evil.node_id, return_future=True), 30
            )

            async def control_arrived() -> bool:
                views = await asyncio.gather(*(p.list_peers() for p in group.peers))
                return all(evil.node_id in view for view in views)

            await wait_until(control_arrived, timeout=30.0)
            bad_subkeys = {schemer.node_id, "c" * 64, timetraveller.node_id}
            for peer in group.peers:
                assert not set(await local_subkeys(peer, dht_key(run, hb))) & bad_subkeys, peer.node_id
                assert await local_subkeys(peer, dht_key(run, pol)) == [], peer.node_id
                view = await peer.list_peers()
                assert not set(view) & bad_subkeys
                assert view[victim.node_id].peer_id == victim.peer_id  # not overwritten by the forgery
                assert await peer.current_policy() is None  # only the operator may announce one
        finally:
            pids = [attacker.pid, *child_pids(attacker.pid)]
            attacker.shutdown()
            end_pids(pids, 3.0)


async def test_policy_is_watched_and_expired_heartbeats_disappear() -> None:
    operator = Identity.generate()
    async with fleet("expire", operator) as group:
        stays = await group.add(operator, heartbeat_interval_s=0.5, heartbeat_ttl_s=2.0)
        goes = await group.add(heartbeat_interval_s=0.5, heartbeat_ttl_s=2.0)

        async def both_seen() -> bool:
            return {stays.node_id, goes.node_id} <= set(await stays.list_peers())

        await wait_until(both_seen, timeout=20.0)
        watcher = goes.watch_policy()
        await stays.publish_policy(1, "01" * 32, [], RUN_PARAMETERS)
        assert (await asyncio.wait_for(anext(watcher), 20.0)).step == 1
        await stays.publish_policy(2, "02" * 32, ["http://127.0.0.1:1/"], RUN_PARAMETERS)
        assert (await asyncio.wait_for(anext(watcher), 20.0)).manifest_sha256 == "02" * 32
        await watcher.aclose()
        await goes.leave()  # stops refreshing; its last heartbeat lives 2 s at most
        left_at = time.monotonic()

        async def gone() -> bool:
            view = await stays.list_peers()
            return goes.node_id not in view and stays.node_id in view

        await wait_until(gone, timeout=15.0)
        assert time.monotonic() - left_at < 15.0  # a 2 s TTL: without expiry it would stay forever


@pytest.mark.slow
async def test_bootstrap_peer_dies_and_the_rest_admit_a_newcomer() -> None:
    operator = Identity.generate()
    async with fleet("bootdeath", operator) as group:
        first = await group.add(operator)
        first_addr = await first.maddrs()
        others = await asyncio.gather(*(group.add(bootstrap=first_addr) for _ in range(3)))
        await first.publish_policy(1, "aa" * 32, [], RUN_PARAMETERS)
        assert first.process is not None
        first.process.kill()  # a crash: no goodbye, its p2pd is gone too
        await first.leave()
        survivor_addr = await others[0].maddrs()
        # The newcomer lists the dead peer first, as a stale config would; it must still get in.
        newcomer = await group.add(bootstrap=first_addr + survivor_addr)
        alive = {p.node_id for p in (*others, newcomer)}

        async def admitted() -> bool:
            views = await asyncio.gather(*(p.list_peers() for p in (*others, newcomer)))
            return all(alive <= set(v) for v in views)

        await wait_until(admitted, timeout=30.0)
        policy = await newcomer.current_policy()  # records outlive the peer that published them
        assert policy is not None and policy.step == 1


async def test_restarted_node_is_recognised_by_its_identity() -> None:
    operator = Identity.generate()
    async with fleet("restart", operator) as group:
        observer = await group.add(operator)
        identity = Identity.generate()
        node = await group.add(identity)
        old_peer = node.peer_id

        async def seen_as(peer_id: str) -> bool:
            view = await observer.list_peers()
            return identity.node_id in view and view[identity.node_id].peer_id == peer_id

        await wait_until(lambda: seen_as(old_peer), timeout=20.0)
        await node.leave()
        again = await group.add(identity)  # same key, new process and new libp2p peer id
        assert again.node_id == identity.node_id and again.peer_id != old_peer
        await wait_until(lambda: seen_as(again.peer_id), timeout=20.0)
        assert list(await observer.list_peers()).count(identity.node_id) == 1

        await observer.publish_ban(identity.node_id, "restart test")
        bans = await again.read_bans()
        assert bans[identity.node_id].reason == "restart test"


async def test_commands_larger_than_the_pipe_reach_the_dht_process() -> None:
    # hivemind sends a command over 16 KiB in two writes and one over 64 KiB in many; its child read them
    # from a non-blocking pipe, lost the framing and never answered (the old "hangs forever" in this file).
    operator = Identity.generate()
    async with fleet("bigcmd", operator) as group:
        peer = await group.add(operator)
        assert peer.process is not None
        key, expiration = dht_key("bigcmd", RecordKind.HEARTBEAT), get_dht_time() + 30
        for size in (20_000, 1_000_000):
            stored = await asyncio.wait_for(
                peer.process.dht.store(key, b"x" * size, expiration, subkey=f"big{size}", return_future=True),
                20,
            )
            assert stored is False  # delivered, then refused by our validator (oversized), not lost
        assert peer.process.dht.is_alive()
        assert peer.node_id in await peer.list_peers()  # the command stream is still in step

        peer.process.kill()  # a crashed DHT process: commands fail at once instead of filling its pipe
        with pytest.raises(SwarmError, match="has exited"):
            await asyncio.wait_for(peer.list_peers(), 5)


async def test_the_dht_child_ends_on_a_sigterm_to_the_group() -> None:
    # A daemon's event loop handles SIGTERM (asyncio installs a no-op handler and a wakeup fd); the forked DHT
    # child inherited both and shrugged off the SIGTERM that systemd or a supervisor sends the whole group,
    # while its p2pd died: shutdown then waited out the grace period, and a killed parent left it orphaned.
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: None)
    operator = Identity.generate()
    try:
        async with fleet("sigterm", operator) as group:
            peer = await group.add(operator)
            assert peer.process is not None
            os.kill(peer.process.dht.pid, signal.SIGTERM)
            peer.process.dht.join(5)
            assert not peer.process.dht.is_alive(), "the DHT child ignored SIGTERM"
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def test_a_dht_child_that_dies_while_starting_fails_the_start_at_once() -> None:
    # A SIGTERM to the process group (systemd, the devnet) can end the child before it is ready; hivemind's
    # ready signal then never comes, and the node sat out the whole start-up timeout (60 s by default)
    # before it could stop.
    dht = SwarmDHT(host_maddrs=LOOPBACK, start=True, await_ready=False)
    try:
        os.kill(dht.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(SwarmError, match=r"the DHT process exited \(-9\) while starting"):
            wait_until_started(dht, 60.0)
        assert time.monotonic() - started < 10
    finally:
        end_pids([dht.pid, *child_pids(dht.pid)], 5.0)
        dht.join(5)


def _die_holding_hivemind_locks() -> None:
    for owner, attribute in SHARED_LOCKS:
        if not getattr(owner, attribute).acquire(timeout=5):
            os._exit(1)
    os._exit(0)  # without releasing: as a DHT child ended in the middle of a write


async def test_a_dht_starts_after_a_child_died_holding_hiveminds_shared_locks(caplog) -> None:
    # The locks are shared by every process forked from this one; before the fix, each later DHT child blocked
    # on its "ready" result and every swarm test after such a death waited out its whole start-up timeout.
    # An earlier test's killed DHT child may already hold one (the very hazard; its next DHT start recovers).
    replace_locks_held_by_the_dead()
    caplog.clear()  # that call may already have logged the warning this test looks for
    dying = multiprocessing.get_context("fork").Process(target=_die_holding_hivemind_locks)
    dying.start()
    dying.join(20)
    if dying.exitcode is None:
        dying.kill()
    assert dying.exitcode == 0
    assert not MPFuture._update_lock.acquire(timeout=0.1)  # held for good by the dead process
    operator = Identity.generate()
    started = time.monotonic()
    async with fleet("deadlock", operator) as group:
        peer = await group.add(operator)
        assert peer.node_id in await peer.list_peers()
    assert time.monotonic() - started < 30
    assert "died holding it" in caplog.text
    for owner, attribute in SHARED_LOCKS:  # fresh and free again
        lock = getattr(owner, attribute)
        assert lock.acquire(timeout=1)
        lock.release()
