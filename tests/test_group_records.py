"""Stage-availability and group records on bytes exactly as hivemind hands them to the DHT validator: honest
ones parse back; forged, misplaced, oversized and non-finite ones are refused with a reason."""

from __future__ import annotations

import json

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.signing import canonical_json
from prime_node.p2p.swarm import RecordError
from prime_node.p2p.swarm.group_records import (
    MAX_KNOWN_PEERS,
    GroupRecord,
    PeerRtt,
    StageAvailability,
    group_id,
)
from prime_node.p2p.swarm.records import RecordKind, key_id, payload_of, seal, seal_payload
from prime_node.p2p.swarm.validator import SwarmRecordValidator
from prime_node.proofs.pipeline.records import GroupSpec

from support.nonces import nonce_at

RUN = "unit-run"
OPERATOR = Identity.from_seed(bytes(range(32)))
NODES = [Identity.from_seed(bytes([40 + i]) * 32) for i in range(4)]
LAYOUT = StageLayout(boundaries=[0, 2, 4])


def offer(node: Identity, **changes: object) -> StageAvailability:
    fields: dict[str, object] = dict(
        node_id=node.node_id,
        stages=[0, 1],
        layer_tokens_per_s=1200.0,
        rtts=[PeerRtt(node_id=NODES[3].node_id, rtt_ms=12.5)],
        reachable=True,
        policy_step=3,
        published_at=1.0,
    )
    fields.update(changes)
    return StageAvailability(**fields)


def group(members: list[str] | None = None, **changes: object) -> GroupRecord:
    members = members or [NODES[0].node_id, NODES[1].node_id]
    fields: dict[str, object] = dict(
        round=1,
        policy_step=3,
        layout=LAYOUT,
        members=members,
        formed_at=1.0,
        signed_at=1.0,
    )
    fields.update(changes)
    fields.setdefault("nonce", nonce_at(fields["formed_at"]))  # type: ignore[arg-type]
    if "group_id" not in changes:  # the digest of what the record names, its layout and nonce included
        fields["group_id"] = group_id(RUN, 3, members, fields["layout"], fields["nonce"])  # type: ignore[arg-type]
    return GroupRecord(**fields)


def record(kind: RecordKind, subkey: str, value: bytes, expiration: float) -> DHTRecord:
    return DHTRecord(
        key_id(RUN, kind), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration
    )


@pytest.fixture()
def validator() -> SwarmRecordValidator:
    return SwarmRecordValidator(RUN, [OPERATOR.node_id])


def test_honest_offer_and_group_parse_back(validator: SwarmRecordValidator) -> None:
    exp = get_dht_time() + 60
    body = offer(NODES[0])
    value = seal(NODES[0], RUN, RecordKind.STAGES, NODES[0].node_id, body, exp)
    assert validator.check(record(RecordKind.STAGES, NODES[0].node_id, value, exp)) == body
    g = group()
    value = seal(OPERATOR, RUN, RecordKind.GROUP, g.group_id, g, exp)
    assert validator.check(record(RecordKind.GROUP, g.group_id, value, exp)) == g
    # The id members derive is the one the group's activation streams open with.
    assert g.group_id == GroupSpec(RUN, 3, 0, LAYOUT, tuple(g.members), g.nonce).group_id


def test_the_largest_offer_and_group_fit_their_size_limits() -> None:
    peers = [Identity.from_seed(bytes([90 + i]) * 32).node_id for i in range(MAX_KNOWN_PEERS)]
    big = offer(
        NODES[0],
        stages=list(range(64)),
        layer_tokens_per_s=1e12 - 1,
        rtts=[PeerRtt(node_id=p, rtt_ms=59_999.123456) for p in peers],
        published_at=8_000_000_000.123,
    )
    payload_of(RecordKind.STAGES, big)  # raises RecordError when over the limit
    members = [Identity.from_seed(bytes([120 + i]) * 32).node_id for i in range(64)]
    layout = StageLayout(boundaries=list(range(0, 65 * 16, 16)))
    payload_of(RecordKind.GROUP, group(members, layout=layout))


def _hostile() -> dict[str, tuple[RecordKind, str, bytes]]:
    exp = get_dht_time() + 60
    n0, n1 = NODES[0], NODES[1]
    g = group()
    fine = canonical_json(offer(n0).model_dump(mode="json"))

    def raw_offer(**changes: object) -> bytes:
        doc = json.loads(fine)
        doc.update(changes)
        return seal_payload(n0, RUN, RecordKind.STAGES, n0.node_id, json.dumps(doc).encode(), exp)

    g_doc = g.model_dump(mode="json")

    def raw_group(signer: Identity = OPERATOR, **changes: object) -> tuple[RecordKind, str, bytes]:
        doc = dict(g_doc, **changes)
        subkey = str(doc["group_id"])
        return (
            RecordKind.GROUP,
            subkey,
            seal_payload(signer, RUN, RecordKind.GROUP, subkey, json.dumps(doc).encode(), exp),
        )

    forged = bytearray(seal(OPERATOR, RUN, RecordKind.GROUP, g.group_id, g, exp))
    forged[40] ^= 1
    other_members = [n0.node_id, NODES[2].node_id]
    return {
        "offer signed by another node": (
            RecordKind.STAGES,
            n0.node_id,
            seal(n1, RUN, RecordKind.STAGES, n0.node_id, offer(n0), exp),
        ),
        "offer with NaN throughput": (
            RecordKind.STAGES,
            n0.node_id,
            raw_offer(layer_tokens_per_s=float("nan")),
        ),
        "offer with infinite throughput": (
            RecordKind.STAGES,
            n0.node_id,
            raw_offer(layer_tokens_per_s=1e999),
        ),
        "offer with zero throughput": (RecordKind.STAGES, n0.node_id, raw_offer(layer_tokens_per_s=0.0)),
        "offer with a negative rtt": (
            RecordKind.STAGES,
            n0.node_id,
            raw_offer(rtts=[{"node_id": n1.node_id, "rtt_ms": -1.0}]),
        ),
        "offer with too many rtts": (
            RecordKind.STAGES,
            n0.node_id,
            raw_offer(rtts=[{"node_id": f"{i:064x}", "rtt_ms": 1.0} for i in range(MAX_KNOWN_PEERS + 1)]),
        ),
        "offer with repeated stages": (RecordKind.STAGES, n0.node_id, raw_offer(stages=[0, 0])),
        "offer with no stage": (RecordKind.STAGES, n0.node_id, raw_offer(stages=[])),
        "offer with an extra field": (RecordKind.STAGES, n0.node_id, raw_offer(gpu_bribe=1)),
        "offer with a string for a number": (
            RecordKind.STAGES,
            n0.node_id,
            raw_offer(layer_tokens_per_s="9e9"),
        ),
        "group with a forged signature": (RecordKind.GROUP, g.group_id, bytes(forged)),
        "group signed by a node": raw_group(n0),
        "group signed by a wrong operator key": raw_group(Identity.from_seed(bytes([7]) * 32)),
        "group under another group's subkey": (
            RecordKind.GROUP,
            group(other_members).group_id,
            seal(OPERATOR, RUN, RecordKind.GROUP, group(other_members).group_id, g, exp),
        ),
        "group naming a node twice": raw_group(members=[n0.node_id, n0.node_id]),
        "group with more members than stages": raw_group(members=[n.node_id for n in NODES[:3]]),
        "group with oversized member list": raw_group(members=[f"{i:064x}" for i in range(65)]),
        "group with a non-hex member": raw_group(members=[n0.node_id, "zz" * 32]),
        "group with bad boundaries": raw_group(layout={"boundaries": [0, 3, 2]}),
        "group with a NaN formation time": raw_group(formed_at=float("nan")),
        # The formation nonce: 48 lowercase hex digits, its first 16 the formation time in ms (formed_at's).
        "group with no nonce": raw_group(nonce=None),
        "group with a short nonce": raw_group(nonce=g.nonce[:-2]),
        "group with a long nonce": raw_group(nonce=g.nonce + "00"),
        "group with an uppercase nonce": raw_group(nonce=g.nonce.upper()),
        "group with a non-hex nonce": raw_group(nonce="zz" + g.nonce[2:]),
        "group with a nonce and a newline": raw_group(nonce=g.nonce + "\n"),
        "group with a nonce of another formation time": raw_group(nonce=nonce_at(2.0)),
        "group whose nonce is not a string": raw_group(nonce=int(g.nonce, 16)),
    }


HOSTILE = _hostile()


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_offers_and_groups_are_refused(validator: SwarmRecordValidator, name: str) -> None:
    kind, subkey, value = HOSTILE[name]
    exp = get_dht_time() + 60
    with pytest.raises(RecordError) as refused:
        validator.check(record(kind, subkey, value, exp))
    assert str(refused.value).strip() and "\n" not in str(refused.value)
    assert not validator.validate(record(kind, subkey, value, exp))


def test_a_group_outlives_no_longer_than_its_kind_allows(validator: SwarmRecordValidator) -> None:
    g = group()
    exp = get_dht_time() + 7 * 86400
    value = seal(OPERATOR, RUN, RecordKind.GROUP, g.group_id, g, exp)
    with pytest.raises(RecordError, match="limit"):
        validator.check(record(RecordKind.GROUP, g.group_id, value, exp))


def test_a_group_id_binds_every_field_of_the_layout() -> None:
    """The same members at the same step under another layout (a trainer restarted with another `[run]` pipeline
    section) form another group, and the record's id and the streams' id (GroupSpec) are computed alike."""
    members = [NODES[0].node_id, NODES[1].node_id]
    layouts = [
        LAYOUT,
        LAYOUT.model_copy(update={"boundaries": [0, 1, LAYOUT.layers]}),
        LAYOUT.model_copy(update={"activation_dtype": "bfloat16"}),
        LAYOUT.model_copy(update={"prompts": LAYOUT.prompts + 1}),
        LAYOUT.model_copy(update={"micro_batch_size": LAYOUT.micro_batch_size + 1}),
    ]
    nonce = nonce_at(1.0)
    ids = [group_id(RUN, 3, members, layout, nonce) for layout in layouts]
    assert len(set(ids)) == len(layouts)
    for layout, gid in zip(layouts, ids, strict=True):
        assert GroupSpec(RUN, 3, 0, layout, tuple(members), nonce).group_id == gid
        copy = StageLayout.model_validate(layout.model_dump(mode="json"))
        assert group_id(RUN, 3, members, copy, nonce) == gid


def test_each_formation_of_the_same_members_is_another_group() -> None:
    """Before the nonce, the same members at the same step under one layout were one group whenever formed, so a
    re-formed group took up the old one's batch numbers and a node had to keep every such group's mark for good
    (in a frozen run it filled its marks file). Each formation's nonce now makes its own id, computed alike by the
    record, the streams (GroupSpec) and a report's claim; a nonce that differs in one byte or its time is another
    group."""
    members = [NODES[0].node_id, NODES[1].node_id]
    first, again = group(members), group(members, formed_at=1.0, nonce=nonce_at(1.0, salt=0x11))
    later = group(members, formed_at=2.0)
    assert len({first.group_id, again.group_id, later.group_id}) == 3
    for g in (first, again, later):
        assert GroupSpec(RUN, 3, 0, LAYOUT, tuple(members), g.nonce).group_id == g.group_id
    flipped = first.nonce[:-1] + ("0" if first.nonce[-1] != "0" else "1")
    assert group_id(RUN, 3, members, LAYOUT, flipped) != first.group_id
    with pytest.raises(ValueError, match="formation time"):  # the nonce's time must be the record's formed_at
        GroupRecord(**dict(first.model_dump(), formed_at=1.5))
