"""Wire schemas of the swarm's DHT records and the signed envelope that carries them.

Every record lives under the key `<run_id>/<kind>` with a subkey that names its owner (a node id, or
`<node id>:<sha256>` for rollouts). Its DHT value is one byte string:

    signer public key (32 bytes) | Ed25519 signature (64 bytes) | payload (canonical JSON of the body)

The signature covers a domain tag, the 20-byte DHT key id, the serialized subkey, the expiration time
and the payload, so a record cannot be moved to another key, another owner's subkey, another run, or
given a longer life. The expiration must be a finite number within the kind's lifetime (MAX_TTL_S): it is
checked first, since a NaN would pass every later comparison. Who may sign is fixed by the kind: the
subkey's owner for heartbeats and rollout announcements, a pinned operator key for policy, validator and
ban records. The signer is checked and the signature verified before the payload is parsed, and bodies
are WireModels (p2p/wire.py: finite floats, printable strings) (docs/protocol.md, "Swarm").
"""

from __future__ import annotations

import math
import struct
from typing import Annotated, Any, Literal

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.utils import MSGPackSerializer
from pydantic import Field, StringConstraints, ValidationError, model_validator

from ..environment_identity import EnvironmentIdentity
from ..identity import Identity
from ..names import MAX_ANNOTATORS, MAX_LENGTH_TARGET, MODEL_LABEL_PATTERN, RUN_ID_PATTERN
from ..pipeline.layout import StageLayout
from ..signing import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, canonical_json, is_valid_signature
from ..wire import (
    FreeText,
    NodeId,
    Sha256Hex,
    Timestamp,
    WireFormatError,
    WireModel,
    describe,
    is_hex64,
    loads_strict,
)
from .errors import RecordError
from .group_records import GroupRecord, StageAvailability
from .kinds import MAX_TTL_S, RecordKind

DOMAIN = b"prime-node/swarm-record/v1\x00"
# How far a peer's clock may run ahead of ours before its records look "from the future".
CLOCK_SKEW_S = 30.0
MAX_SUBKEY_BYTES = 160

# libp2p peer ids in base58 (Ed25519/RSA identities): no 0, O, I or l.
PeerIdB58 = Annotated[str, StringConstraints(pattern=r"^[1-9A-HJ-NP-Za-km-z]{32,64}$")]
Maddr = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^/")]
ShortText = Annotated[str, StringConstraints(max_length=64)]
HttpUrlText = Annotated[str, StringConstraints(max_length=256, pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")]
Role = Literal["contributor", "trainer", "validator", "relay"]


OPERATOR_KINDS = frozenset({RecordKind.POLICY, RecordKind.VALIDATOR, RecordKind.BAN, RecordKind.GROUP})
MAX_PAYLOAD_BYTES: dict[RecordKind, int] = {
    RecordKind.HEARTBEAT: 4096,
    RecordKind.POLICY: 8192,
    RecordKind.VALIDATOR: 4096,
    RecordKind.BAN: 1024,
    RecordKind.ROLLOUT: 1024,
    RecordKind.STAGES: 4096,
    RecordKind.GROUP: 8192,
}
MAX_VALUE_BYTES = PUBLIC_KEY_BYTES + SIGNATURE_BYTES + max(MAX_PAYLOAD_BYTES.values())


class Hardware(WireModel):
    gpu_model: Annotated[str, FreeText(64)] | None = (
        None  # e.g. "NVIDIA H100 80GB HBM3"; None on CPU-only nodes
    )
    gpu_memory_mb: int = Field(0, ge=0, le=1 << 24)
    cpu: Annotated[str, FreeText(64)] = ""
    cpu_cores: int = Field(0, ge=0, le=1 << 16)
    ram_mb: int = Field(0, ge=0, le=1 << 32)


class Heartbeat(WireModel):
    node_id: NodeId  # must equal the subkey and the signer
    peer_id: PeerIdB58  # the libp2p peer id this node currently uses: binds streams to the node id
    version: ShortText  # prime-node software version
    roles: list[Role] = Field(max_length=4)
    hardware: Hardware
    addresses: list[Maddr] = Field(max_length=8)  # where it can be dialled; empty in client mode
    client_mode: bool  # True when the node could not be dialled and runs as a DHT client
    policy_step: int | None = Field(None, ge=0)  # the policy step it works on
    serves_steps: list[Annotated[int, Field(ge=0)]] = Field(max_length=16)  # checkpoints it can serve
    sent_at: Timestamp
    weights_url: HttpUrlText | None = None  # its weights server (p2p/weights) when serves_steps is not empty
    # The pipelined group this node confirms it runs a stage of (group_records.GroupRecord); None outside a
    # group. A group is live only while every member's fresh heartbeat names it (trainer/groups/).
    group: Sha256Hex | None = None
    # The group this node gave up because its batches kept breaking or none finished (node/pipeline/host.py),
    # named while the node avoids it; None otherwise. The coordinator then does not cool the node down as a
    # member that never confirmed, and keeps it apart from that group's other members for a while
    # (trainer/groups/plan.py). Self-declared, so it buys nothing else; `group` is the truth: a heartbeat cannot
    # both confirm a group and say it left it.
    left_group: Sha256Hex | None = None

    @model_validator(mode="after")
    def _left_group_is_not_confirmed(self) -> Heartbeat:
        if self.left_group is not None and self.left_group == self.group:
            raise ValueError(
                "left_group names the group this heartbeat confirms (group): a node cannot run a group and have "
                "left it"
            )
        return self


class RunParameters(WireModel):
    """The run's parameters every contributor and validator must share (node/run/settings.RunSettings).

    The operator announces them with every policy, so a party configured otherwise finds out at once, with
    the setting to change, instead of producing work the validators reject as not this run's, or (for a
    validator) rejecting every honest file. Field meanings: docs/protocol.md, "Swarm".
    """

    run_id: Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN)]
    run_seed: int = Field(ge=0, lt=1 << 64)
    environment: EnvironmentIdentity  # the run's task environment (p2p/environment_identity.py)
    samples: int = Field(ge=1, le=1024)
    temperature: float = Field(gt=0, le=10)
    max_new_tokens: int = Field(ge=1, le=8192)
    compute_dtype: Literal["float32", "bfloat16"]
    length_targets: list[Annotated[int, Field(ge=1, le=MAX_LENGTH_TARGET)]] = Field(max_length=32)
    length_alpha: float = Field(ge=0, le=1)
    # SHA-256 of the run's system prompt (UTF-8), None without one: a digest, not the text, so that a long
    # prompt cannot push the policy record past its size limit, and no free text travels in it.
    system_prompt_sha256: Sha256Hex | None = None
    # "synthetic": the model is frozen and the run's product is the verified dataset (docs/synthetic.md).
    # Absent in an older trainer's record: an RL run, as every run then was.
    run_kind: Literal["rl", "synthetic"] = "rl"
    # Labels of the models that annotate task difficulty in a synthetic run (empty otherwise).
    annotators: list[Annotated[str, StringConstraints(pattern=MODEL_LABEL_PATTERN)]] = Field(
        default_factory=list, max_length=MAX_ANNOTATORS
    )
    # The run's pipeline stage layout (p2p/pipeline/layout.py; docs/pipeline.md), None when the run has no
    # pipelined groups. Absent in older records: None.
    pipeline: StageLayout | None = None


class PolicyAnnouncement(WireModel):
    step: int = Field(ge=0)
    manifest_sha256: Sha256Hex  # hash of the signed shard manifest of this checkpoint
    sources: list[Annotated[str, StringConstraints(min_length=1, max_length=512)]] = Field(max_length=32)
    published_at: Timestamp
    run: RunParameters  # what every rollout for this policy must be produced with
    # The trainer will never publish another step: a synthetic run's model. Required of a synthetic run's
    # policy, so a record claiming one kind of run and the other behaviour is refused when read.
    frozen: bool = False

    @model_validator(mode="after")
    def _frozen_when_synthetic(self) -> PolicyAnnouncement:
        if self.frozen != (self.run.run_kind == "synthetic"):
            raise ValueError(
                f"a {self.run.run_kind} run's policy must say frozen={self.run.run_kind == 'synthetic'}"
            )
        return self


class ValidatorAnnouncement(WireModel):
    node_id: NodeId  # must equal the subkey; the key that signs hand-off receipts
    peer_id: PeerIdB58  # where rollout files are streamed to
    addresses: list[Maddr] = Field(max_length=8)
    max_rollout_bytes: int = Field(ge=0, le=1 << 31)
    published_at: Timestamp
    api_url: HttpUrlText | None = (
        None  # its HTTP API (verdicts, leaderboard: docs/validator.md), if reachable
    )
    # The first policy step whose work it judges (p2p/swarm/routing.py): a validator joining a running swarm
    # takes no batch of a step the others may already have judged. Absent (older validators): 0.
    from_step: int = Field(0, ge=0, lt=1 << 63)


class Ban(WireModel):
    node_id: NodeId  # the banned node; must equal the subkey
    reason: Annotated[str, FreeText(256)]
    banned_at: Timestamp


class RolloutAnnouncement(WireModel):
    node_id: NodeId  # author; subkey is "<node_id>:<sha256>"
    sha256: Sha256Hex
    size_bytes: int = Field(ge=0, le=1 << 31)
    step: int = Field(ge=0)
    samples: int = Field(ge=0, le=1 << 24)
    announced_at: Timestamp


BODY_TYPES: dict[RecordKind, type[WireModel]] = {
    RecordKind.HEARTBEAT: Heartbeat,
    RecordKind.POLICY: PolicyAnnouncement,
    RecordKind.VALIDATOR: ValidatorAnnouncement,
    RecordKind.BAN: Ban,
    RecordKind.ROLLOUT: RolloutAnnouncement,
    RecordKind.STAGES: StageAvailability,
    RecordKind.GROUP: GroupRecord,
}


def dht_key(run_id: str, kind: RecordKind) -> str:
    return f"{run_id}/{kind.value}"


def key_id(run_id: str, kind: RecordKind) -> bytes:
    """The 20-byte id hivemind stores `dht_key` under; validators only ever see this id."""
    return DHTID.generate(source=dht_key(run_id, kind)).to_bytes()


def subkey_owner(kind: RecordKind, subkey: str) -> str:
    """The node id a subkey names (the part before ':' for rollouts); RecordError when malformed."""
    owner, _, rest = subkey.partition(":")
    if not is_hex64(owner):
        raise RecordError(f"{kind.value} subkey {subkey[:80]!r} does not start with a node id")
    if kind is RecordKind.ROLLOUT:
        if not is_hex64(rest):
            raise RecordError(f"rollout subkey {subkey[:80]!r} is not '<node id>:<sha256>'")
    elif rest or ":" in subkey:
        raise RecordError(f"{kind.value} subkey {subkey[:80]!r} must be a bare node id")
    return owner


def _signed_message(kid: bytes, subkey_bytes: bytes, expiration: float, payload: bytes) -> bytes:
    return (
        DOMAIN
        + kid
        + struct.pack(">I", len(subkey_bytes))
        + subkey_bytes
        + struct.pack(">d", expiration)
        + payload
    )


def seal(
    identity: Identity, run_id: str, kind: RecordKind, subkey: str, body: WireModel, expiration: float
) -> bytes:
    """Sign `body` for storage under (`run_id`/`kind`, `subkey`) until `expiration`: the DHT value bytes."""
    if not isinstance(body, BODY_TYPES[kind]):
        raise RecordError(
            f"a {kind.value} record needs a {BODY_TYPES[kind].__name__}, got {type(body).__name__}"
        )
    return seal_payload(identity, run_id, kind, subkey, payload_of(kind, body), expiration)


def payload_of(kind: RecordKind, body: WireModel) -> bytes:
    """`body`'s payload bytes; RecordError when they exceed the kind's limit (peers would refuse the record)."""
    payload = canonical_json(body.model_dump(mode="json"))
    if len(payload) > MAX_PAYLOAD_BYTES[kind]:
        raise RecordError(
            f"{kind.value} record is {len(payload)} bytes; the limit is {MAX_PAYLOAD_BYTES[kind]}"
        )
    return payload


def seal_payload(
    identity: Identity, run_id: str, kind: RecordKind, subkey: str, payload: bytes, expiration: float
) -> bytes:
    """Sign raw payload bytes without checking them (seal's lower half; tests use it to forge records)."""
    subkey_bytes = MSGPackSerializer.dumps(subkey)
    signature = identity.sign(_signed_message(key_id(run_id, kind), subkey_bytes, expiration, payload))
    return identity.public_key + signature + payload


def unpack_scalar(raw: bytes, expect: type[str] | type[bytes], limit: int, what: str) -> Any:
    """One msgpack str or bin of at most `limit` bytes; containers and extension types are refused unread."""
    if len(raw) > limit + 5:  # 5 bytes is the largest msgpack str/bin header
        raise RecordError(f"{what} is {len(raw)} bytes; at most {limit} allowed")
    try:
        value = msgpack.unpackb(
            raw,
            raw=False,
            max_str_len=limit if expect is str else 0,
            max_bin_len=limit if expect is bytes else 0,
            max_array_len=0,
            max_map_len=0,
            max_ext_len=0,
        )
    except (ValueError, msgpack.UnpackException) as exc:
        raise RecordError(f"{what} is not a msgpack {expect.__name__}: {exc}") from None
    if not isinstance(value, expect):
        raise RecordError(f"{what} must be {expect.__name__}, got {type(value).__name__}")
    return value


def decode_subkey(subkey_bytes: bytes) -> str:
    """The subkey as hivemind serialized it (a msgpack str)."""
    return unpack_scalar(subkey_bytes, str, MAX_SUBKEY_BYTES, "subkey")


def check_expiration(kind: RecordKind, expiration: object, now: float) -> float:
    """The record's DHT expiration time if it is finite and within the kind's lifetime; RecordError otherwise.

    The first check on every record, before any comparison: hivemind keeps a NaN expiration for ever (every
    `expiration < now` is false), never replaces it (`old < new` is false too) and, once it reaches the top of
    a table's expiry heap, stops expiring the table's other entries; an infinite one outlives every bound.
    """
    if (
        isinstance(expiration, bool)
        or not isinstance(expiration, (int, float))
        or not math.isfinite(expiration)
    ):
        raise RecordError(f"{kind.value} record's expiration {expiration!r} is not a finite number")
    if expiration > now + MAX_TTL_S[kind] + CLOCK_SKEW_S:
        raise RecordError(
            f"{kind.value} record's expiration is {expiration - now:.0f} s from now; "
            f"limit {MAX_TTL_S[kind]:.0f} s"
        )
    return float(expiration)


def reopen_record(
    run_id: str,
    kind: RecordKind,
    subkey: str,
    value: bytes,
    expiration: float,
    operator_keys: frozenset[str],
    now: float,
) -> WireModel:
    """`open_record` on a record kept outside the DHT (its subkey as a string): the same checks, its signature
    included; an expired record opens too (the keeper decides how long it is worth keeping)."""
    return open_record(
        kind, key_id(run_id, kind), MSGPackSerializer.dumps(subkey), value, expiration, operator_keys, now
    )


def open_record(
    kind: RecordKind,
    kid: bytes,
    subkey_bytes: bytes,
    value: bytes,
    expiration: float,
    operator_keys: frozenset[str],
    now: float,
) -> WireModel:
    """Check and parse one record: size, expiry, subkey, signer, signature, and only then the payload."""
    if not isinstance(value, bytes) or len(value) > MAX_VALUE_BYTES:
        raise RecordError(f"{kind.value} value is not bytes of at most {MAX_VALUE_BYTES}")
    check_expiration(kind, expiration, now)
    subkey = decode_subkey(subkey_bytes)
    owner = subkey_owner(kind, subkey)
    head = PUBLIC_KEY_BYTES + SIGNATURE_BYTES
    if len(value) <= head:
        raise RecordError(f"{kind.value} value of {len(value)} bytes has no payload")
    signer = value[:PUBLIC_KEY_BYTES].hex()
    signature = value[PUBLIC_KEY_BYTES:head]
    payload = value[head:]
    if len(payload) > MAX_PAYLOAD_BYTES[kind]:
        raise RecordError(
            f"{kind.value} payload is {len(payload)} bytes; the limit is {MAX_PAYLOAD_BYTES[kind]}"
        )
    if kind in OPERATOR_KINDS:
        if signer not in operator_keys:
            raise RecordError(
                f"{kind.value} record signed by {signer[:16]}…, which is not a pinned operator key"
            )
        if kind is RecordKind.POLICY and owner != signer:
            raise RecordError("policy subkey must be the signing operator's key")
    elif signer != owner:
        raise RecordError(f"{kind.value} record under {owner[:16]}…'s subkey is signed by {signer[:16]}…")
    if not is_valid_signature(signer, _signed_message(kid, subkey_bytes, expiration, payload), signature):
        raise RecordError(f"{kind.value} record under subkey {subkey[:24]}… has a bad signature")
    try:  # strict JSON first (duplicate keys, NaN, a lone surrogate refused where they are), then the schema
        body = BODY_TYPES[kind].model_validate(loads_strict(payload, f"{kind.value} payload"), strict=True)
    except WireFormatError as exc:
        raise RecordError(str(exc)) from None
    except ValidationError as exc:  # names the field: e.g. an old peer's policy lacks `run`
        raise RecordError(f"{kind.value} payload does not match its schema {describe(exc)}") from None
    _check_binding(kind, subkey, owner, body)
    return body


def _check_binding(kind: RecordKind, subkey: str, owner: str, body: WireModel) -> None:
    # The body repeats the owner so that a record read on its own (logs, ledgers) still names it.
    node_id = getattr(body, "node_id", owner)
    if node_id != owner:
        raise RecordError(f"{kind.value} body names node {node_id[:16]}… but its subkey names {owner[:16]}…")
    if isinstance(body, RolloutAnnouncement) and subkey != f"{body.node_id}:{body.sha256}":
        raise RecordError("rollout subkey does not match the announced file hash")
    if isinstance(body, GroupRecord) and subkey != body.group_id:
        raise RecordError(f"group record under subkey {subkey[:16]}… names group {body.group_id[:16]}…")
