"""Signed swarm records and the DHT validator, on bytes exactly as hivemind hands them over."""

from __future__ import annotations

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from pydantic import ValidationError

from prime_node.p2p.identity import Identity
from prime_node.p2p.signing import canonical_json
from prime_node.p2p.swarm import (
    Ban,
    Hardware,
    Heartbeat,
    PolicyAnnouncement,
    RecordError,
    RolloutAnnouncement,
    SwarmConfig,
    ValidatorAnnouncement,
)
from prime_node.p2p.swarm.records import RecordKind, dht_key, key_id, open_record, seal, seal_payload
from prime_node.p2p.swarm.validator import SwarmRecordValidator

from support.swarm import RUN_PARAMETERS

RUN = "unit-run"
OPERATOR = Identity.from_seed(bytes(range(32)))
NODE = Identity.from_seed(bytes(range(1, 33)))
OTHER = Identity.from_seed(bytes(range(2, 34)))


def heartbeat(node: Identity, **changes: object) -> Heartbeat:
    fields = dict(
        node_id=node.node_id,
        peer_id="12D3KooWLtPGnEYZ57XxMm1XZVfb9vLStjt5xvxMGaYtTKhRbtFK",
        version="0.1.0",
        roles=["contributor"],
        hardware=Hardware(cpu="x86", cpu_cores=2, ram_mb=1024),
        addresses=["/ip4/127.0.0.1/tcp/4001"],
        client_mode=False,
        policy_step=3,
        serves_steps=[2, 3],
        sent_at=1.0,
    )
    fields.update(changes)
    return Heartbeat(**fields)


def policy(step: int = 7) -> PolicyAnnouncement:
    return PolicyAnnouncement(
        step=step,
        manifest_sha256="ab" * 32,
        sources=["http://127.0.0.1:1/"],
        published_at=1.0,
        run=RUN_PARAMETERS,
    )


def as_record(kind: RecordKind, subkey: str, value: bytes, expiration: float, run: str = RUN) -> DHTRecord:
    # Exactly what hivemind's protocol passes to validators: key id, msgpack subkey, msgpack value.
    return DHTRecord(
        key_id(run, kind), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration
    )


@pytest.fixture()
def validator() -> SwarmRecordValidator:
    return SwarmRecordValidator(RUN, [OPERATOR.node_id])


def test_honest_records_validate_and_parse_back(validator: SwarmRecordValidator) -> None:
    exp = get_dht_time() + 30
    hb = heartbeat(NODE)
    rec = as_record(
        RecordKind.HEARTBEAT, NODE.node_id, seal(NODE, RUN, RecordKind.HEARTBEAT, NODE.node_id, hb, exp), exp
    )
    assert validator.validate(rec)
    assert validator.check(rec) == hb
    pol = as_record(
        RecordKind.POLICY,
        OPERATOR.node_id,
        seal(OPERATOR, RUN, RecordKind.POLICY, OPERATOR.node_id, policy(), exp),
        exp,
    )
    assert validator.check(pol) == policy()
    ban = Ban(node_id=OTHER.node_id, reason="bad TOPLOC", banned_at=1.0)
    assert validator.validate(
        as_record(
            RecordKind.BAN, OTHER.node_id, seal(OPERATOR, RUN, RecordKind.BAN, OTHER.node_id, ban, exp), exp
        )
    )


def validator_of(node: Identity) -> ValidatorAnnouncement:
    return ValidatorAnnouncement(
        node_id=node.node_id,
        peer_id="12D3KooWLtPGnEYZ57XxMm1XZVfb9vLStjt5xvxMGaYtTKhRbtFK",
        addresses=["/ip4/127.0.0.1/tcp/4001"],
        max_rollout_bytes=1 << 20,
        published_at=1.0,
    )


def rollout_of(node: Identity, sha256: str = "cd" * 32) -> RolloutAnnouncement:
    return RolloutAnnouncement(
        node_id=node.node_id, sha256=sha256, size_bytes=4096, step=3, samples=16, announced_at=1.0
    )


def test_validator_and_rollout_announcements_validate(validator: SwarmRecordValidator) -> None:
    exp = get_dht_time() + 30
    val, roll = RecordKind.VALIDATOR, RecordKind.ROLLOUT
    sealed = seal(OPERATOR, RUN, val, NODE.node_id, validator_of(NODE), exp)
    announced = as_record(val, NODE.node_id, sealed, exp)
    assert validator.check(announced) == validator_of(NODE)
    subkey = f"{NODE.node_id}:{'cd' * 32}"
    rollout = as_record(roll, subkey, seal(NODE, RUN, roll, subkey, rollout_of(NODE), exp), exp)
    assert validator.check(rollout) == rollout_of(NODE)


def forgeries() -> dict[str, DHTRecord]:
    exp = get_dht_time() + 30
    good = seal(NODE, RUN, RecordKind.HEARTBEAT, NODE.node_id, heartbeat(NODE), exp)
    flipped = good[:40] + bytes([good[40] ^ 1]) + good[41:]
    payload = canonical_json(heartbeat(NODE).model_dump(mode="json"))
    hb = RecordKind.HEARTBEAT
    return {
        "bad signature": as_record(hb, NODE.node_id, flipped, exp),
        "tampered payload": as_record(
            hb, NODE.node_id, good.replace(b'"policy_step":3', b'"policy_step":4'), exp
        ),
        "another owner's subkey": as_record(
            hb, NODE.node_id, seal_payload(OTHER, RUN, hb, NODE.node_id, payload, exp), exp
        ),
        "body names another node": as_record(
            hb, OTHER.node_id, seal(OTHER, RUN, hb, OTHER.node_id, heartbeat(NODE), exp), exp
        ),
        "bad schema": as_record(
            hb,
            NODE.node_id,
            seal_payload(
                NODE, RUN, hb, NODE.node_id, payload.replace(b'"policy_step":3', b'"policy_step":"3"'), exp
            ),
            exp,
        ),
        "unknown field": as_record(
            hb,
            NODE.node_id,
            seal_payload(NODE, RUN, hb, NODE.node_id, payload[:-1] + b',"extra":1}', exp),
            exp,
        ),
        "oversized value": as_record(
            hb, NODE.node_id, seal_payload(NODE, RUN, hb, NODE.node_id, payload + b" " * 20000, exp), exp
        ),
        "far-future expiry": as_record(
            hb, NODE.node_id, seal(NODE, RUN, hb, NODE.node_id, heartbeat(NODE), exp + 86400), exp + 86400
        ),
        "expiry extended after signing": as_record(hb, NODE.node_id, good, exp + 10),
        "policy not signed by the operator": as_record(
            RecordKind.POLICY,
            NODE.node_id,
            seal(NODE, RUN, RecordKind.POLICY, NODE.node_id, policy(), exp),
            exp,
        ),
        # The operator's key, but a policy an older trainer wrote (no run parameters) or one whose run
        # parameters are out of bounds: readers must not act on a policy whose run they cannot check.
        "policy without run parameters": as_record(
            RecordKind.POLICY,
            OPERATOR.node_id,
            seal_payload(
                OPERATOR,
                RUN,
                RecordKind.POLICY,
                OPERATOR.node_id,
                canonical_json(policy().model_dump(mode="json", exclude={"run"})),
                exp,
            ),
            exp,
        ),
        "policy with a zero temperature": as_record(
            RecordKind.POLICY,
            OPERATOR.node_id,
            seal_payload(
                OPERATOR,
                RUN,
                RecordKind.POLICY,
                OPERATOR.node_id,
                canonical_json(
                    {
                        **policy().model_dump(mode="json"),
                        "run": {**RUN_PARAMETERS.model_dump(mode="json"), "temperature": 0.0},
                    }
                ),
                exp,
            ),
            exp,
        ),
        "ban not signed by the operator": as_record(
            RecordKind.BAN,
            OTHER.node_id,
            seal(
                NODE,
                RUN,
                RecordKind.BAN,
                OTHER.node_id,
                Ban(node_id=OTHER.node_id, reason="x", banned_at=1.0),
                exp,
            ),
            exp,
        ),
        "validator announced by a non-operator": as_record(
            RecordKind.VALIDATOR,
            NODE.node_id,
            seal(NODE, RUN, RecordKind.VALIDATOR, NODE.node_id, validator_of(NODE), exp),
            exp,
        ),
        "rollout announcement under another file's subkey": as_record(
            RecordKind.ROLLOUT,
            f"{NODE.node_id}:{'ef' * 32}",
            seal(NODE, RUN, RecordKind.ROLLOUT, f"{NODE.node_id}:{'ef' * 32}", rollout_of(NODE), exp),
            exp,
        ),
        "rollout announced for another node": as_record(
            RecordKind.ROLLOUT,
            f"{OTHER.node_id}:{'cd' * 32}",
            seal(NODE, RUN, RecordKind.ROLLOUT, f"{OTHER.node_id}:{'cd' * 32}", rollout_of(NODE), exp),
            exp,
        ),
        "heartbeat replayed under the policy key": DHTRecord(
            key_id(RUN, RecordKind.POLICY),
            MSGPackSerializer.dumps(NODE.node_id),
            MSGPackSerializer.dumps(good),
            exp,
        ),
        "record replayed into another run": as_record(hb, NODE.node_id, good, exp, run="other-run"),
        "value without subkey": DHTRecord(
            key_id(RUN, hb), MSGPackSerializer.dumps(None), MSGPackSerializer.dumps(good), exp
        ),
        "value is not bytes": DHTRecord(
            key_id(RUN, hb), MSGPackSerializer.dumps(NODE.node_id), MSGPackSerializer.dumps({"a": 1}), exp
        ),
        "truncated value": as_record(hb, NODE.node_id, good[:90], exp),
    }


@pytest.mark.parametrize("name", list(forgeries()))
def test_every_forgery_is_refused(validator: SwarmRecordValidator, name: str) -> None:
    record = forgeries()[name]
    assert not validator.validate(record)
    with pytest.raises(RecordError):
        validator.check(record)


def test_keys_of_other_runs_are_refused_not_ignored(validator: SwarmRecordValidator) -> None:
    exp = get_dht_time() + 30
    stray = DHTRecord(
        b"\x01" * 20, MSGPackSerializer.dumps(None), MSGPackSerializer.dumps(b"free storage"), exp
    )
    assert not validator.validate(stray)


def test_schemas_are_strict() -> None:
    with pytest.raises(ValidationError):
        heartbeat(NODE, policy_step="3")
    with pytest.raises(ValidationError):
        heartbeat(NODE, node_id="XY" * 32)
    with pytest.raises(RecordError):  # seal refuses a body of the wrong kind
        seal(NODE, RUN, RecordKind.POLICY, NODE.node_id, heartbeat(NODE), get_dht_time() + 5)
    assert dht_key(RUN, RecordKind.BAN) == "unit-run/ban"


def test_config_checks_fields() -> None:
    with pytest.raises(ValidationError, match="heartbeat_ttl_s"):
        SwarmConfig(heartbeat_interval_s=30, heartbeat_ttl_s=20)
    with pytest.raises(ValidationError, match="p2p"):
        SwarmConfig(initial_peers=["/ip4/127.0.0.1/tcp/4001"])
    with pytest.raises(ValidationError, match="multiaddr"):
        SwarmConfig(host_maddrs=["127.0.0.1:4001"])
    with pytest.raises(ValidationError, match="operator key"):
        SwarmConfig(operator_keys=["not-hex"])
    with pytest.raises(ValidationError):
        SwarmConfig(heartbeat_ttl_s=10_000)  # beyond what honest peers accept
    with pytest.raises(ValidationError, match="beam_size"):
        SwarmConfig(beam_size=4)  # a beam must reach the 5 peers that store each record


def test_accepted_records_are_remembered_but_refusals_are_not(validator: SwarmRecordValidator) -> None:
    exp = get_dht_time() + 30
    value = seal(NODE, RUN, RecordKind.HEARTBEAT, NODE.node_id, heartbeat(NODE), exp)
    record = as_record(RecordKind.HEARTBEAT, NODE.node_id, value, exp)
    assert validator.validate(record) and validator.validate(record)
    # A cached acceptance covers only these exact bytes: any change is checked afresh and refused.
    assert not validator.validate(as_record(RecordKind.HEARTBEAT, NODE.node_id, value, exp + 1))
    assert not validator.validate(as_record(RecordKind.HEARTBEAT, OTHER.node_id, value, exp))
    for name, forged in forgeries().items():
        assert not validator.validate(forged) and not validator.validate(forged), name


def test_a_table_is_judged_entry_by_entry_up_to_a_cap_of_refusals() -> None:
    """The DHT child's table check (p2p/swarm/process.py) drops the entries its validator refuses and keeps
    the rest; past MAX_REFUSED_ENTRIES refusals it refuses the whole table without checking further."""
    from types import SimpleNamespace

    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils import MSGPackSerializer, get_dht_time

    from prime_node.p2p.swarm.process import MAX_REFUSED_ENTRIES, _keep_valid_entries

    checked: list[bytes] = []

    class RefusesBad:
        def validate(self, record) -> bool:  # noqa: ANN001
            checked.append(record.value)
            return not record.value.startswith(b"bad")

    def table(good: int, bad: int) -> DictionaryDHTValue:
        out, expiry = DictionaryDHTValue(), get_dht_time() + 60
        for i in range(good):
            out.store(f"good-{i}", b"good", expiry)
        for i in range(bad):
            out.store(f"bad-{i}", b"bad", expiry)
        return out

    protocol = SimpleNamespace(record_validator=RefusesBad(), serializer=MSGPackSerializer)
    few = table(3, MAX_REFUSED_ENTRIES)
    assert _keep_valid_entries(protocol, b"key", few)
    assert sorted(subkey for subkey, _ in few.items()) == ["good-0", "good-1", "good-2"]
    assert not _keep_valid_entries(protocol, b"key", table(0, 1))  # nothing valid left: refused
    checked.clear()
    assert not _keep_valid_entries(
        protocol, b"key", table(3, 50)
    )  # junk: refused, and not checked to the end
    assert checked.count(b"bad") == MAX_REFUSED_ENTRIES + 1


def _open_policy_payload(payload: bytes) -> PolicyAnnouncement:
    """The reader's whole check (open_record) of an operator-signed policy made of `payload`."""
    exp = get_dht_time() + 30
    value = seal_payload(OPERATOR, RUN, RecordKind.POLICY, OPERATOR.node_id, payload, exp)
    return open_record(
        RecordKind.POLICY,
        key_id(RUN, RecordKind.POLICY),
        MSGPackSerializer.dumps(OPERATOR.node_id),
        value,
        exp,
        frozenset([OPERATOR.node_id]),
        get_dht_time(),
    )


def _open_policy(run: dict) -> PolicyAnnouncement:
    return _open_policy_payload(canonical_json({**policy().model_dump(mode="json"), "run": run}))


ENVIRONMENT = RUN_PARAMETERS.environment.model_dump(mode="json")
EDGES = [  # (field, accepted at the edge, refused past it)
    ("run_id", "a" * 64, "-leading-dash"),
    ("run_seed", 2**64 - 1, 2**64),
    ("environment", {**ENVIRONMENT, "name": "e" * 64}, {**ENVIRONMENT, "name": "e" * 65}),
    ("environment", {**ENVIRONMENT, "name": "e_2"}, {**ENVIRONMENT, "name": "Env"}),
    ("environment", {**ENVIRONMENT, "package": "p" * 64}, {**ENVIRONMENT, "package": "p" * 65}),
    ("environment", {**ENVIRONMENT, "package": "reasoning-gym"}, {**ENVIRONMENT, "package": "two words"}),
    ("environment", {**ENVIRONMENT, "version": "1" * 48}, {**ENVIRONMENT, "version": "1" * 49}),
    ("environment", {**ENVIRONMENT, "version": "1.0+local.2"}, {**ENVIRONMENT, "version": "1.0\n"}),
    (
        "environment",
        {**ENVIRONMENT, "content_hash": "sha256:" + "f" * 64},
        {**ENVIRONMENT, "content_hash": "F" * 64},
    ),
    ("environment", ENVIRONMENT, {**ENVIRONMENT, "extra": "x"}),
    ("samples", 1024, 0),
    ("temperature", 10.0, 0.0),
    ("max_new_tokens", 8192, 8193),
    ("compute_dtype", "bfloat16", "float16"),
    ("length_targets", [1_000_000] * 32, [1] * 33),
    ("length_targets", [1], [0]),
    ("length_targets", [1_000_000], [1_000_001]),
    ("length_alpha", 1.0, 1.5),
    ("length_alpha", 0.0, -0.1),
    ("run_seed", 0, "0"),
]


@pytest.mark.parametrize(("field", "edge", "past"), EDGES)
def test_policy_run_parameters_are_bounded_on_the_wire_and_refusals_name_the_field(field, edge, past) -> None:
    run = RUN_PARAMETERS.model_dump(mode="json")
    assert _open_policy({**run, field: edge}).run.model_dump(mode="json")[field] == edge
    with pytest.raises(RecordError, match=rf"policy payload does not match its schema at run\.{field}"):
        _open_policy({**run, field: past})


def test_policy_run_parameters_refuse_nan_extra_fields_and_a_missing_run() -> None:
    run = RUN_PARAMETERS.model_dump(mode="json")
    body = canonical_json({**policy().model_dump(mode="json"), "run": run})
    assert b'"length_alpha":0.001' in body
    with pytest.raises(RecordError, match=r"at run\.length_alpha"):
        _open_policy_payload(body.replace(b'"length_alpha":0.001', b'"length_alpha":NaN'))
    with pytest.raises(RecordError, match=r"at run\.note: Extra inputs"):
        _open_policy({**run, "note": "x"})
    with pytest.raises(RecordError, match=r"at run: Field required"):  # what an older trainer's record gives
        _open_policy_payload(canonical_json(policy().model_dump(mode="json", exclude={"run"})))
