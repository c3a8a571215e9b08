"""Non-finite numbers in DHT records, sent by a hostile peer through real hivemind peers on 127.0.0.1.

The attacker runs hivemind without our record validator, so it stores and serves whatever it likes; every
record it sends is correctly signed by its own keys. Before the fix, honest peers stored a heartbeat whose
expiration was NaN (every `expiration > limit` and `expiration < now` is false for NaN): it never expired,
and no later record could replace it under its subkey (`NaN < newer` is false too). And the expiration a
peer puts beside a whole table in a find reply ended a lookup when it was +inf.
"""

from __future__ import annotations

import asyncio
import json

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from prime_node.p2p.identity import Identity
from prime_node.p2p.processes import child_pids, end_pids
from prime_node.p2p.signing import canonical_json
from prime_node.p2p.swarm.process import SwarmDHT
from prime_node.p2p.swarm.records import RecordKind, dht_key, key_id, open_record, seal, seal_payload
from prime_node.p2p.swarm.validator import SwarmRecordValidator

from support.swarm import LOOPBACK, RUN_PARAMETERS, fleet, local_subkeys, wait_until


async def test_records_with_non_finite_numbers_are_refused_and_pin_nothing() -> None:
    operator = Identity.generate()
    run = "nonfinite"
    key = dht_key(run, RecordKind.HEARTBEAT)
    async with fleet(run, operator) as group:
        owner = await group.add(operator, heartbeat_interval_s=1.0)
        reader = await group.add(heartbeat_interval_s=1.0)
        attacker = SwarmDHT(initial_peers=await group.bootstrap(), start=True, host_maddrs=LOOPBACK)
        try:
            template = (await reader.list_peers())[owner.node_id]

            def heartbeat(identity: Identity, **changes: object) -> object:
                return template.model_copy(update={"node_id": identity.node_id, **changes})

            def nan_sent_at(identity: Identity, expiration: float) -> bytes:
                # canonical JSON cannot carry NaN: the attacker writes the literal itself, and signs the bytes
                document = heartbeat(identity).model_dump(mode="json") | {"sent_at": "\x01"}
                payload = canonical_json(document).replace(json.dumps("\x01").encode(), b"NaN")
                return seal_payload(
                    identity, run, RecordKind.HEARTBEAT, identity.node_id, payload, expiration
                )

            soon = get_dht_time() + 60
            nan_expiry, inf_expiry, minus_inf_expiry, nan_value, pinner, control = (
                Identity.generate() for _ in range(6)
            )
            hb = RecordKind.HEARTBEAT
            hostile = {  # identity: (value, expiration)
                nan_expiry: (
                    seal(nan_expiry, run, hb, nan_expiry.node_id, heartbeat(nan_expiry), float("nan")),
                    float("nan"),
                ),
                inf_expiry: (
                    seal(inf_expiry, run, hb, inf_expiry.node_id, heartbeat(inf_expiry), float("inf")),
                    float("inf"),
                ),
                minus_inf_expiry: (
                    seal(
                        minus_inf_expiry,
                        run,
                        hb,
                        minus_inf_expiry.node_id,
                        heartbeat(minus_inf_expiry),
                        float("-inf"),
                    ),
                    float("-inf"),
                ),
                nan_value: (nan_sent_at(nan_value, soon), soon),
                # Tries to pin its subkey: a NaN-dated record first, a correct one (policy step 1) after it.
                pinner: (
                    seal(pinner, run, hb, pinner.node_id, heartbeat(pinner), float("nan")),
                    float("nan"),
                ),
            }
            for identity, (value, expiration) in hostile.items():
                await asyncio.wait_for(
                    attacker.store(key, value, expiration, subkey=identity.node_id, return_future=True), 30
                )
            later = seal(pinner, run, hb, pinner.node_id, heartbeat(pinner, policy_step=1), soon)
            await asyncio.wait_for(
                attacker.store(key, later, soon, subkey=pinner.node_id, return_future=True), 30
            )
            # Control: a correctly dated, correctly signed record from the same attacker is accepted.
            good = seal(control, run, hb, control.node_id, heartbeat(control), soon)
            await asyncio.wait_for(
                attacker.store(key, good, soon, subkey=control.node_id, return_future=True), 30
            )
            # The honest owner moves on meanwhile: its next heartbeats carry policy step 7.
            owner.policy_step = 7

            async def settled() -> bool:
                views = await asyncio.gather(*(p.list_peers() for p in group.peers))
                return all(control.node_id in v and v[owner.node_id].policy_step == 7 for v in views) and all(
                    pinner.node_id in v and v[pinner.node_id].policy_step == 1 for v in views
                )

            await wait_until(settled, timeout=30.0)
            refused = {i.node_id for i in (nan_expiry, inf_expiry, minus_inf_expiry, nan_value)}
            for peer in group.peers:
                assert not set(await local_subkeys(peer, key)) & refused, peer.node_id
                view = await peer.list_peers()
                assert not set(view) & refused, peer.node_id
                assert view[pinner.node_id].policy_step == 1  # the NaN-dated record pinned nothing
                assert view[owner.node_id].policy_step == 7 and view[reader.node_id].peer_id == reader.peer_id
        finally:
            pids = [attacker.pid, *child_pids(attacker.pid)]
            attacker.shutdown()
            end_pids(pids, 3.0)


class _InfinitelyFreshDHT(SwarmDHT):
    """A hostile peer: asked for `target`, it answers an empty table dated +inf (the float beside the table
    in hivemind's find reply), hiding the honest records it holds. Everything else it answers honestly."""

    def __init__(self, target: bytes, **kwargs: object) -> None:
        self.target = target
        super().__init__(**kwargs)

    def run(self) -> None:  # in the child only
        stock, target = DHTProtocol.rpc_find, self.target

        async def lying_find(protocol: DHTProtocol, request: dht_pb2.FindRequest, context: object) -> object:
            response = await stock(protocol, request, context)
            for key, result in zip(request.keys, response.results):
                if key == target:
                    result.type = dht_pb2.FOUND_DICTIONARY
                    result.value = MSGPackSerializer.dumps(DictionaryDHTValue())
                    result.expiration_time = float("inf")
            return response

        DHTProtocol.rpc_find = lying_find  # type: ignore[method-assign]
        super().run()


async def test_a_reply_dated_infinity_does_not_end_a_lookup() -> None:
    # Stock hivemind ends a `latest` lookup at the first reply whose expiration is >= +inf: the peer nearest
    # to the key, answering first, made the run's policy invisible. The reader below asks one peer at a time
    # (num_workers=1), nearest first, so the hostile peer (whose DHT id is next to the key's) always answers
    # first: the outcome does not depend on which reply wins a race.
    operator = Identity.generate()
    run = "infreply"
    kid = key_id(run, RecordKind.POLICY)
    async with fleet(run, operator) as group:
        owner = await group.add(operator)
        liar = _InfinitelyFreshDHT(
            kid,
            initial_peers=await owner.maddrs(),
            start=True,
            host_maddrs=LOOPBACK,
            node_id=DHTID(int.from_bytes(kid, "big") ^ 1),
        )
        reader = SwarmDHT(
            initial_peers=await owner.maddrs(),
            start=True,
            host_maddrs=LOOPBACK,
            client_mode=True,
            num_workers=1,
            record_validators=[SwarmRecordValidator(run, [operator.node_id])],
        )
        try:
            assert await owner.publish_policy(4, "04" * 32, [], RUN_PARAMETERS)
            found = await asyncio.wait_for(
                reader.get(dht_key(run, RecordKind.POLICY), latest=True, return_future=True), 30
            )
            assert found is not None and operator.node_id in found.value, (
                "the lookup ended at the hostile reply"
            )
            item = found.value[operator.node_id]
            body = open_record(
                RecordKind.POLICY,
                kid,
                MSGPackSerializer.dumps(operator.node_id),
                item.value,
                item.expiration_time,
                frozenset({operator.node_id}),
                get_dht_time(),
            )
            assert body.step == 4 and found.expiration_time == item.expiration_time < float("inf")
            # The honest control: a swarm peer reads the same policy the ordinary way.
            assert (await owner.current_policy()).step == 4
        finally:
            pids = [p for dht in (liar, reader) for p in (dht.pid, *child_pids(dht.pid))]
            liar.shutdown()
            reader.shutdown()
            end_pids(pids, 3.0)
