"""What a reader gets back from the DHT: every heartbeat field, and the good entries of a mixed table."""

from __future__ import annotations

import time

from hivemind.utils import get_dht_time

from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import Hardware, PolicyAnnouncement
from prime_node.p2p.swarm.hardware import software_version
from prime_node.p2p.swarm.records import RecordKind, dht_key, seal

from support.swarm import RUN_PARAMETERS, fleet, wait_until


async def test_heartbeat_carries_every_field_the_node_sets() -> None:
    operator = Identity.generate()
    gpu = Hardware(
        gpu_model="NVIDIA H100 80GB HBM3", gpu_memory_mb=81559, cpu="test cpu", cpu_cores=2, ram_mb=4096
    )
    async with fleet("fields", operator) as group:
        observer = await group.add(operator)
        node = await group.add(roles=("contributor", "relay"), hardware=gpu)
        first = (await observer.list_peers())[node.node_id]
        assert first.policy_step is None and first.serves_steps == [] and first.weights_url is None

        node.policy_step, node.serves_steps = 7, [6, 7]
        node.weights_url = "http://127.0.0.1:8123/weights"
        # The next heartbeat (every heartbeat_interval_s, 2 s here) carries what the node works on now.

        async def updated() -> bool:
            seen = (await observer.list_peers()).get(node.node_id)
            return seen is not None and seen.policy_step == 7

        await wait_until(updated, timeout=20.0)
        seen = (await observer.list_peers())[node.node_id]
        assert (seen.node_id, seen.peer_id, seen.version) == (node.node_id, node.peer_id, software_version())
        assert seen.roles == ["contributor", "relay"] and seen.hardware == gpu
        assert (seen.policy_step, seen.serves_steps, seen.weights_url) == (7, [6, 7], node.weights_url)
        assert not seen.client_mode and seen.addresses == (await node.maddrs())[:8]
        suffix = f"/p2p/{node.peer_id}"
        assert all(a.startswith("/ip4/127.0.0.1/tcp/") and a.endswith(suffix) for a in seen.addresses)
        assert first.sent_at < seen.sent_at <= time.time()  # refreshed, not the join-time record


async def test_one_refused_entry_does_not_hide_the_rest_of_its_table() -> None:
    # A second operator key is pinned by the storing peer but not (yet) by the reader: a key rotation, or
    # two operator configs out of step. Stock hivemind drops a peer's whole table when one entry fails, so
    # the reader, which can only read through that peer, would see no policy at all.
    old_key, new_key = Identity.generate(), Identity.generate()
    run = "mixedkeys"
    async with fleet(run, old_key) as group:
        storer = await group.add(new_key, operator_keys=[old_key.node_id, new_key.node_id])
        reader = await group.add(reachability="private")  # a DHT client: stores nothing, reads from storer
        assert reader.client_mode and not storer.client_mode
        expiration = get_dht_time() + 60
        old_policy = PolicyAnnouncement(
            step=5, manifest_sha256="05" * 32, sources=[], published_at=1.0, run=RUN_PARAMETERS
        )
        value = seal(old_key, run, RecordKind.POLICY, old_key.node_id, old_policy, expiration)
        assert await storer.process.dht.store(  # type: ignore[union-attr]
            dht_key(run, RecordKind.POLICY), value, expiration, subkey=old_key.node_id, return_future=True
        )
        assert await storer.publish_policy(9, "09" * 32, [], RUN_PARAMETERS)
        assert {p.step for p in (await storer._read(RecordKind.POLICY)).values()} == {5, 9}

        async def reader_sees_old_policy() -> bool:
            policy = await reader.current_policy()
            return policy is not None and policy.step == 5

        await wait_until(reader_sees_old_policy, timeout=20.0)
        assert (await storer.current_policy()).step == 9  # type: ignore[union-attr]
        assert {p.step for p in (await reader._read(RecordKind.POLICY)).values()} == {5}
