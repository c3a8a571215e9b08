"""Every wire type refuses non-finite numbers and unprintable text, found by walking the types themselves.

Nothing here lists fields. The wire types are discovered: every pydantic model defined in prime_node.p2p
(the wire package) must be a WireModel or one of the LOCAL_TYPES, and every WireModel anywhere must be
reachable from a CARRIER: a top-level type, an honest sample of it, and the function production uses to
parse a peer's bytes of it (the DHT record validator hivemind calls, open_signed, parse_signed, the hand-off
frame decoder, the validator-API client). For every float field found by walking the carrier's type (nested
models, lists, dicts, unions, optionals), the peer's bytes carry NaN, Infinity, -Infinity, 1e999 and, past a
bound, +-1e308 in that place; for every string field, a control or format character or a lone surrogate
(valid JSON, `"\\ud800"`, but no UTF-8 form: it cannot be signed). Each must be refused with a message that
names the field, and the untouched sample must pass (the honest control). A signed carrier also has forgeries:
the same bad bytes signed by a key the reader does not trust, or under a bad signature, so that the reader's
path before (and through) its signature check meets every bad value too; each forgery must be refused with
the carrier's own error, never another exception. A wire type or field added later is fuzzed without editing
this file; a new carrier needs one sample.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib
import json
import pkgutil
import random
import re
import tempfile
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

import prime_node.p2p
from prime_node.p2p.environment_identity import EnvironmentIdentity
from prime_node.p2p.errors import SignatureError
from prime_node.p2p.identity import Identity
from prime_node.p2p.names import RUN_ID_PATTERN
from prime_node.p2p.pipeline.errors import PipelineWireError
from prime_node.p2p.pipeline.frames import PROTOCOL as PIPELINE_PROTOCOL
from prime_node.p2p.pipeline.frames import (
    Acknowledgement,
    ChainReader,
    FrameHeader,
    StreamOpening,
    chain_next,
    chain_start,
    head_message,
)
from prime_node.p2p.pipeline.group_ids import group_id_of
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.signing import canonical_json
from prime_node.p2p.swarm import SwarmConfig
from prime_node.p2p.swarm.errors import HandoffError, RecordError
from prime_node.p2p.swarm.framing import decode_frame
from prime_node.p2p.swarm.group_records import GroupRecord, PeerRtt, StageAvailability, group_id
from prime_node.p2p.swarm.handoff import Receipt, ReceiptBody, RolloutEnvelope, parse_header, parse_receipt
from prime_node.p2p.swarm.records import (
    Ban,
    Hardware,
    Heartbeat,
    PolicyAnnouncement,
    RecordKind,
    RolloutAnnouncement,
    RunParameters,
    ValidatorAnnouncement,
    key_id,
    seal,
    seal_payload,
)
from prime_node.p2p.swarm.validator import SwarmRecordValidator
from prime_node.p2p.validator_api import (
    ErrorAnswer,
    Leaderboard,
    NodeDetail,
    NodeHistory,
    RewardCurve,
    SwarmView,
    ValidatorApiError,
    parse_answer,
)
from prime_node.p2p.verdicts import BanRecord, DocumentError, Signed, Verdict, open_signed
from prime_node.p2p.weights.availability import (
    AvailabilityBody,
    AvailabilityError,
    encode_bitmap,
    parse_availability,
)
from prime_node.p2p.weights.errors import ManifestError
from prime_node.p2p.weights.fetch import FetchSettings
from prime_node.p2p.weights.guard import ServeLimits
from prime_node.p2p.weights.manifest import (
    FileEntry,
    ManifestBody,
    ShardEntry,
    SignedManifest,
    checkpoint_digest,
    parse_signed,
    sign_manifest,
)
from prime_node.p2p.weights.server import ServeSettings
from prime_node.p2p.weights.sources import SelectionSettings
from prime_node.p2p.wire import WireFormatError, WireModel, loads_strict
from prime_node.proofs.pipeline.records import (
    RECORD_DOMAIN,
    HopRecord,
    SignedStageRecord,
    StageRecord,
    StageRecordError,
    parse_stage_record,
)
from prime_node.proofs.pipeline.reports import (
    BatchClaim,
    FraudReport,
    PartialReport,
    read_fraud_report,
    read_partial_report,
)
from prime_node.proofs.rollout_file import sign_bytes, signature_path
from prime_node.proofs.rollout_schema import RolloutFileError

from support.nonces import nonce_at

RUN = "fuzz"
T = 1_800_000_000.0
OPERATOR = Identity.from_seed(b"\x21" * 32)
NODE = Identity.from_seed(b"\x22" * 32)
VALIDATOR = Identity.from_seed(b"\x23" * 32)
STRANGER = Identity.from_seed(b"\x24" * 32)  # a key no reader trusts
RECEIVER = Identity.from_seed(b"\x25" * 32)  # stage 1 of a pipelined group whose stage 0 is NODE
PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
SHA = "ab" * 32
# Not wire types: settings the operator writes, and containers built only after a parse has succeeded.
LOCAL_TYPES = (
    SwarmConfig,
    FetchSettings,
    ServeSettings,
    ServeLimits,
    SelectionSettings,
    Signed,
    SignedManifest,
)
# Control characters (C0, DEL, C1), Unicode line/paragraph separators, a bidi override, a zero-width space,
# lone surrogates (high and low: no UTF-8 form, so canonical JSON cannot hold them).
BAD_CHARS = [
    "\n",
    "\r",
    "\t",
    "\x00",
    "\x1b",
    "\x7f",
    "\x85",
    "\u2028",
    "\u2029",
    "\u202e",
    "\u200b",
    "\ud800",
    "\udfff",
]


# ----- carriers: a top-level wire type, an honest sample, and production's parse of a peer's bytes ----------


@dataclass(frozen=True)
class Carrier:
    model: type[WireModel]
    sample: dict[str, Any]
    parse: Callable[[bytes], Any]
    error: type[Exception]
    # Parsers of the same bytes signed by an untrusted key or under a bad signature: refused whatever they hold.
    forged: tuple[Callable[[bytes], Any], ...] = ()


def _sign_or_zero(identity: Identity, raw: bytes) -> bytes:
    """What an attacker can sign: canonical JSON has no NaN and no lone surrogate, so some are left unsigned."""
    try:
        return identity.sign_document(json.loads(raw))
    except (SignatureError, UnicodeError):  # UnicodeError: what an older signer raised for a lone surrogate
        return bytes(64)


def _record(kind: RecordKind, signer: Identity, subkey: str, body: WireModel) -> Carrier:
    validator = SwarmRecordValidator(RUN, [OPERATOR.node_id])

    def parse(
        payload: bytes,
    ) -> Any:  # what hivemind hands the validator for a record a peer stores or returns
        expiration = get_dht_time() + 60
        value = seal_payload(signer, RUN, kind, subkey, payload, expiration)
        serialized = MSGPackSerializer.dumps(value)
        record = DHTRecord(key_id(RUN, kind), MSGPackSerializer.dumps(subkey), serialized, expiration)
        return validator.check(record)

    def forged(by: Identity, flip: bool) -> Callable[[bytes], Any]:
        def parse_forged(payload: bytes) -> Any:
            expiration = get_dht_time() + 60
            value = bytearray(seal_payload(by, RUN, kind, subkey, payload, expiration))
            if flip:
                value[32] ^= 1  # the signature's first byte
            record = DHTRecord(
                key_id(RUN, kind),
                MSGPackSerializer.dumps(subkey),
                MSGPackSerializer.dumps(bytes(value)),
                expiration,
            )
            return validator.check(record)

        return parse_forged

    return Carrier(
        type(body),
        body.model_dump(mode="json"),
        parse,
        RecordError,
        (forged(STRANGER, False), forged(signer, True)),
    )


def _signed_document(
    model: type[Verdict] | type[BanRecord], signer: Identity, document: WireModel
) -> Carrier:
    def opened(raw: bytes, signature: bytes) -> Any:  # the body of GET /api/verdict/..., or a ban envelope
        envelope = b'{"document":' + raw + b',"signature":"' + signature.hex().encode() + b'"}'
        return open_signed(envelope, model, {signer.node_id})

    return Carrier(
        model,
        document.model_dump(mode="json"),
        lambda raw: opened(raw, _sign_or_zero(signer, raw)),
        DocumentError,
        (
            lambda raw: opened(
                raw, _sign_or_zero(STRANGER, raw)
            ),  # names the trusted signer, signed by another
            lambda raw: opened(raw, b"\xab" * 64),  # a signature that verifies nothing
        ),
    )


def _manifest_body() -> ManifestBody:
    shard = "cd" * 32
    return ManifestBody(
        format="prime-node-weights",
        format_version=1,
        run_id=RUN,
        step=3,
        created_at=int(T),
        signer=OPERATOR.node_id,
        shard_size=1024,
        total_size=10,
        checkpoint_sha256=checkpoint_digest([shard]),
        files=[FileEntry(path="config.json", size=10, sha256=SHA)],
        shards=[ShardEntry(size=10, sha256=shard)],
    )


def _manifest() -> Carrier:
    body = _manifest_body()

    def parse(raw: bytes, signature: bytes) -> Any:  # a manifest as a weights source serves it
        return parse_signed(
            b'{"body":' + raw + b',"signature":"' + signature.hex().encode() + b'"}', OPERATOR.node_id
        )

    return Carrier(
        ManifestBody,
        body.model_dump(mode="json"),
        lambda raw: parse(raw, _sign_or_zero(OPERATOR, raw)),  # signed by the pinned key
        ManifestError,
        (lambda raw: parse(raw, _sign_or_zero(STRANGER, raw)), lambda raw: parse(raw, b"\xab" * 64)),
    )


def _availability() -> Carrier:
    """A weights server's signed shard availability as a fetcher reads it (GET /v1/weights/{step}/availability)."""
    manifest = sign_manifest(_manifest_body(), OPERATOR)
    body = AvailabilityBody(
        format="prime-node-availability",
        version=1,
        node_id=NODE.node_id,
        step=manifest.step,
        manifest_sha256=manifest.digest,
        shard_count=1,
        have=encode_bitmap({0}, 1),
        issued_at_ms=int(T * 1000),
    )

    def parse(raw: bytes, signature: bytes) -> Any:
        document = b'{"body":' + raw + b',"signature":"' + signature.hex().encode() + b'"}'
        return parse_availability(document, manifest, signers={NODE.node_id}, now=T)

    return Carrier(
        AvailabilityBody,
        body.model_dump(mode="json"),
        lambda raw: parse(raw, _sign_or_zero(NODE, raw)),  # signed by the node it names
        AvailabilityError,
        (lambda raw: parse(raw, _sign_or_zero(STRANGER, raw)), lambda raw: parse(raw, b"\xab" * 64)),
    )


def _receipt() -> Carrier:
    body = ReceiptBody(sha256=SHA, sender=NODE.node_id, receiver=VALIDATOR.node_id, size=10, received_at=T)
    receipt = Receipt(body=body, signature=VALIDATOR.sign_document(body.model_dump(mode="json")).hex())

    def parse(raw: bytes) -> Receipt:  # the sender's read of the answer frame
        return parse_receipt(decode_frame(b'{"receipt":' + raw + b"}")["receipt"])

    def forged(signer: Identity) -> Callable[[bytes], Any]:
        def parse_forged(raw: bytes) -> None:  # then the sender's signature check, as handoff.send runs it
            document = json.loads(raw)
            document["signature"] = _sign_or_zero(signer, json.dumps(document["body"]).encode()).hex()
            parse(json.dumps(document).encode()).verify(VALIDATOR.node_id, SHA, NODE.node_id)

        return parse_forged

    return Carrier(Receipt, receipt.model_dump(mode="json"), parse, HandoffError, (forged(STRANGER),))


_OPENING = StreamOpening(
    protocol=PIPELINE_PROTOCOL,
    run_id=RUN,
    group=SHA,
    policy_step=1,
    batch=2,
    stage=0,
    stages=2,
    sender=NODE.node_id,
)
# A frame's acknowledgement of its input (the predecessor's chain head, its index and signature): shaped, not
# checked here.
_ACK = Acknowledgement(head=SHA, index=3, signature="cd" * 64)


def _pipeline(model: type[WireModel], sample: WireModel) -> Carrier:
    """A pipeline stream's opening or frame header as the next stage reads it (p2p/pipeline/frames.py): the
    sender signs the chain head over the bytes it sends (canonical JSON where the document has one)."""

    def canonical(raw: bytes) -> bytes:
        try:
            return canonical_json(loads_strict(raw))
        except (WireFormatError, SignatureError):
            return raw  # no canonical form (a NaN): sent as it is

    def read(raw: bytes, signer: Identity | None) -> Any:
        raw = canonical(raw)
        chain = ChainReader(NODE.node_id, StageLayout(boundaries=[0, 1, 2]))
        if model is StreamOpening:
            message = head_message(hashlib.sha256(raw).digest(), 0, chain_start(raw))
            return chain.open(raw, signer.sign(message) if signer else b"\xab" * 64)
        opening = canonical_json(_OPENING.model_dump(mode="json"))
        digest = hashlib.sha256(opening).digest()
        chain.open(opening, NODE.sign(head_message(digest, 0, chain_start(opening))))
        message = head_message(digest, 1, chain_next(chain.head, raw))
        return chain.header(raw, signer.sign(message) if signer else b"\xab" * 64)

    return Carrier(
        model,
        sample.model_dump(mode="json"),
        lambda raw: read(raw, NODE),
        PipelineWireError,
        (lambda raw: read(raw, STRANGER), lambda raw: read(raw, None)),
    )


def _stage_record() -> Carrier:
    """A pipeline stage's record as the validator reads it (proofs/pipeline/records.py parse_stage_record)."""
    header = FrameHeader(
        index=1,
        micro_batch=0,
        kind="tokens",
        step=0,
        rows=[0],
        shape=[1],
        dtype="int64",
        tensor_sha256=SHA,
        commitment="00ff",
        acknowledged=_ACK,
    )
    hop = HopRecord(opening=_OPENING, headers=[header], head=SHA, signature="cd" * 64)
    record = StageRecord(stage=0, node_id=NODE.node_id, received=hop, sent=hop, outputs=[[5, 1]])

    sample = SignedStageRecord.sign(record, NODE).model_dump(mode="json")

    def read(raw: bytes, signer: Identity | None) -> Any:
        try:  # the member signs whatever record it sends, when it has a canonical form
            document = loads_strict(raw)
            if document["signature"] == sample["signature"]:  # (a fuzzed signature is sent as it is)
                payload = RECORD_DOMAIN + canonical_json(document["record"])
                document["signature"] = signer.sign(payload).hex() if signer else "ab" * 64
            raw = json.dumps(document).encode()
        except (WireFormatError, SignatureError):
            pass
        return parse_stage_record(raw, NODE.node_id)

    return Carrier(
        SignedStageRecord,
        sample,
        lambda raw: read(raw, NODE),
        StageRecordError,
        (lambda raw: read(raw, STRANGER), lambda raw: read(raw, None)),
    )


def _group_report(
    model: type[WireModel], sample: WireModel, kind: str, reader: Callable[[Path], Any]
) -> Carrier:
    """A pipelined group's report as the validator reads it (proofs/pipeline/reports.py): the body's bytes under a
    v3 envelope of `kind` signed by the stream's receiver (the record's member), signing the claim's group and batch
    when the body names them."""

    def read(raw: bytes, signer: Identity | None) -> Any:
        try:
            claim = loads_strict(raw)["claim"]
            group = group_id_of(
                claim["run_id"],
                claim["policy_step"],
                claim["members"],
                claim["layout_sha256"],
                claim["nonce"],
            )
            batch = (int(claim["policy_step"]), int(claim["batch"]))
        except (WireFormatError, KeyError, TypeError, ValueError):
            group, batch = SHA, (1, 2)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "report.json"
            path.write_bytes(raw)
            envelope = sign_bytes(raw, signer or STRANGER, batch=batch, group=group, kind=kind)
            if signer is None:
                envelope["signature"] = "ab" * 64
            signature_path(path).write_text(json.dumps(envelope))
            return reader(path)

    signer = RECEIVER if kind == "fraud" else NODE
    return Carrier(
        model,
        sample.model_dump(mode="json"),
        lambda raw: read(raw, signer),
        RolloutFileError,
        (lambda raw: read(raw, STRANGER), lambda raw: read(raw, None)),
    )


_CLAIM = BatchClaim(
    run_id=RUN,
    policy_step=1,
    batch=2,
    members=[NODE.node_id, RECEIVER.node_id],
    prompts=1,
    micro_batch_size=1,
    layout_sha256="ab" * 32,
    nonce=nonce_at(T),
)


def _fraud_report() -> Carrier:
    header = FrameHeader(
        index=1,
        micro_batch=0,
        kind="prefill",
        step=0,
        rows=[0],
        shape=[1, 1, 2],
        dtype="float32",
        tensor_sha256=SHA,
        commitment="00ff",
        acknowledged=_ACK,
    )
    hop = HopRecord(opening=_OPENING, headers=[header], head=SHA, signature="cd" * 64)
    report = FraudReport(claim=_CLAIM, hop=hop, tensor="AAAAAAAAAAA=")
    return _group_report(FraudReport, report, "fraud", read_fraud_report)


def _partial_report() -> Carrier:
    header = FrameHeader(
        index=1,
        micro_batch=0,
        kind="tokens",
        step=0,
        rows=[0],
        shape=[1],
        dtype="int64",
        tensor_sha256=SHA,
        commitment="00ff",
        acknowledged=_ACK,
    )
    hop = HopRecord(opening=_OPENING, headers=[header], head=SHA, signature="cd" * 64)
    record = StageRecord(stage=0, node_id=NODE.node_id, received=hop, sent=hop, outputs=[[5]])
    report = PartialReport(claim=_CLAIM, record=SignedStageRecord.sign(record, NODE))

    def read(path: Path) -> Any:  # the member signs whatever record it sends, when it has a canonical form
        try:  # (a body that is not JSON at all is the reader's to refuse)
            document = json.loads(path.read_bytes())
            payload = RECORD_DOMAIN + canonical_json(document["record"]["record"])
            document["record"]["signature"] = NODE.sign(payload).hex()
        except (KeyError, TypeError, ValueError, SignatureError):
            pass
        return read_partial_report(path)

    return _group_report(PartialReport, report, "partial", read)


def _answer(model: type[WireModel], sample: dict[str, Any], what: str) -> Carrier:
    """An answer of the validator's HTTP API as its one client parses it (p2p/validator_api.py)."""
    return Carrier(model, sample, lambda raw: parse_answer(raw, model, what), ValidatorApiError)


_ROW = {
    "rank": 1,
    "node_id": NODE.node_id,
    "accepted_tokens": 3,
    "accepted_samples": 2,
    "accepted_files": 1,
    "rejected_files": 0,
    "score": 2.5,
    "slashes": 1,
    "slashed": 5.0,
    "banned": True,
    "ban_permanent": False,
    "banned_until": T + 60,
    "last_step": 4,
    "first_seen": T,
    "last_seen": T,
    "hardware": {"gpu_model": "NVIDIA H100", "cpu_cores": 2, "ram_gb": 1.5},
}


CARRIERS = [
    _record(
        RecordKind.HEARTBEAT,
        NODE,
        NODE.node_id,
        Heartbeat(
            node_id=NODE.node_id,
            peer_id=PEER_ID,
            version="0.1.0",
            roles=["contributor"],
            hardware=Hardware(gpu_model="NVIDIA H100", gpu_memory_mb=1, cpu="x86", cpu_cores=2, ram_mb=4),
            addresses=["/ip4/127.0.0.1/tcp/1"],
            client_mode=False,
            policy_step=1,
            serves_steps=[1],
            sent_at=T,
            weights_url="http://127.0.0.1:1/w",
            group=SHA,
            left_group="5e" * 32,  # a group it gave up (docs/pipeline.md): never the one it confirms
        ),
    ),
    _record(
        RecordKind.POLICY,
        OPERATOR,
        OPERATOR.node_id,
        PolicyAnnouncement(
            step=1,
            manifest_sha256=SHA,
            sources=["http://127.0.0.1:1/"],
            published_at=T,
            run=RunParameters(
                run_id=RUN,
                run_seed=0,
                environment=EnvironmentIdentity(
                    name="arithmetic",
                    package="prime-node",
                    version="0.1.0",
                    content_hash="sha256:" + "ab" * 32,
                ),
                samples=4,
                temperature=1.0,
                max_new_tokens=64,
                compute_dtype="float32",
                length_targets=[10],
                length_alpha=0.001,
                system_prompt_sha256=SHA,
                run_kind="synthetic",
                annotators=["small"],
                pipeline=StageLayout(boundaries=[0, 2, 4]),
            ),
            frozen=True,
        ),
    ),
    _record(
        RecordKind.VALIDATOR,
        OPERATOR,
        VALIDATOR.node_id,
        ValidatorAnnouncement(
            node_id=VALIDATOR.node_id,
            peer_id=PEER_ID,
            addresses=["/ip4/127.0.0.1/tcp/1"],
            max_rollout_bytes=1,
            published_at=T,
            api_url="http://127.0.0.1:2",
        ),
    ),
    _record(RecordKind.BAN, OPERATOR, NODE.node_id, Ban(node_id=NODE.node_id, reason="fraud", banned_at=T)),
    _record(
        RecordKind.ROLLOUT,
        NODE,
        f"{NODE.node_id}:{SHA}",
        RolloutAnnouncement(
            node_id=NODE.node_id, sha256=SHA, size_bytes=10, step=1, samples=4, announced_at=T
        ),
    ),
    _record(
        RecordKind.STAGES,
        NODE,
        NODE.node_id,
        StageAvailability(
            node_id=NODE.node_id,
            stages=[0, 1],
            layer_tokens_per_s=1000.0,
            rtts=[PeerRtt(node_id=OPERATOR.node_id, rtt_ms=30.0)],
            reachable=True,
            policy_step=1,
            published_at=T,
        ),
    ),
    _record(
        RecordKind.GROUP,
        OPERATOR,
        group_id(RUN, 1, [NODE.node_id, VALIDATOR.node_id], StageLayout(boundaries=[0, 2, 4]), nonce_at(T)),
        GroupRecord(
            group_id=group_id(
                RUN, 1, [NODE.node_id, VALIDATOR.node_id], StageLayout(boundaries=[0, 2, 4]), nonce_at(T)
            ),
            round=1,
            policy_step=1,
            layout=StageLayout(boundaries=[0, 2, 4]),
            members=[NODE.node_id, VALIDATOR.node_id],
            formed_at=T,
            signed_at=T,
            nonce=nonce_at(T),
        ),
    ),
    _signed_document(
        Verdict,
        VALIDATOR,
        Verdict(
            file_hash=SHA,
            node_id=NODE.node_id,
            step=1,
            samples=0,
            tokens=0,
            accepted=False,
            failed_check="bounds",
            reason="row 0: reward is not a finite number",
            validator_id=VALIDATOR.node_id,
            decided_at=T,
        ),
    ),
    _signed_document(
        BanRecord,
        OPERATOR,
        BanRecord(
            node_id=NODE.node_id, reason="fraud", issued_at=T, until=T + 60, issuer_id=OPERATOR.node_id
        ),
    ),
    Carrier(
        RolloutEnvelope,
        # A stage file's (v3) envelope: every field present, `group` included (v2 leaves it out).
        RolloutEnvelope.sign(NODE, b"rollout bytes", (3, 1), group=SHA).model_dump(mode="json"),
        lambda raw: parse_header(decode_frame(raw)),
        HandoffError,
    ),
    _receipt(),
    _manifest(),
    _availability(),
    _pipeline(StreamOpening, _OPENING),
    _stage_record(),
    _fraud_report(),
    _partial_report(),
    _pipeline(
        FrameHeader,
        FrameHeader(
            index=1,
            micro_batch=0,
            kind="prefill",
            step=0,
            rows=[0],
            shape=[1, 2, 4],
            dtype="float32",
            tensor_sha256=SHA,
            commitment="00ff",
            acknowledged=_ACK,
        ),
    ),
    _answer(Leaderboard, {"generated_at": T, "ranked": 1, "nodes": [_ROW]}, "the leaderboard"),
    _answer(
        NodeDetail,
        {
            "node": _ROW,
            "ranked": 1,
            "recent": [
                {
                    "file_hash": SHA,
                    "step": 4,
                    "samples": 2,
                    "tokens": 3,
                    "accepted": False,
                    "failed_check": "bounds",
                    "reason": "row 0: reward is not a finite number",
                    "decided_at": T,
                }
            ],
            "slash_log": [
                {
                    "file_hash": SHA,
                    "amount": 5.0,
                    "check_class": "fault",
                    "failed_check": "bounds",
                    "reason": "row 0",
                    "created_at": T,
                }
            ],
            "bans": [
                {
                    "id": 1,
                    "reason": "bounds",
                    "created_at": T,
                    "until": T + 60,
                    "lifted_at": T + 1,
                    "file_hash": SHA,
                }
            ],
        },
        "the node entry",
    ),
    _answer(
        SwarmView,
        {
            "available": True,
            "policy_step": 4,
            "nodes": [
                {
                    "node_id": NODE.node_id,
                    "role": "contributor",
                    "roles": ["contributor"],
                    "state": "banned",
                    "version": "0.1.0",
                    "reachability": "relayed",
                    "reachability_hint": "open its TCP port",
                    "hardware": {"cpu": "x86", "ram_gb": 1.5},
                    "step": 4,
                    "last_seen": T,
                    "accepted_files": 1,
                    "rejected_files": 1,
                    "accepted_tokens": 3,
                    "tokens_per_s": 0.5,
                    "rollouts_per_min": 1.5,
                    "slashes": 1,
                    "ban": {
                        "reason": "fraud: rewards check failed",
                        "failed_check": "rewards",
                        "slash_reason": "row 0",
                        "since": T,
                        "until": T + 60,
                    },
                }
            ],
            "generated_at": T,
            "window_s": 600.0,
            "stale_after_s": 60.0,
            "totals": {
                "nodes": 1,
                "banned": 1,
                "accepted_files": 1,
                "accepted_tokens": 3,
                "accepted_samples": 2,
            },
            "queue": {
                "depth": 1,
                "held": 0,
                "verdict_latency_s": 0.5,
                "latency_over": 2,
                "verdicts_per_min": 3.0,
            },
            "trainer": {
                "state": "stalled",
                "node_id": NODE.node_id,
                "step": 4,
                "step_at": T,
                "announced_at": T,
                "stall_after_s": 900.0,
                "hint": "no new step",
            },
        },
        "the swarm",
    ),
    _answer(
        NodeHistory,
        {"node_id": NODE.node_id, "points": [{"step": 4, "accepted": 1, "rejected": 0, "tokens": 3}]},
        "a node's history",
    ),
    _answer(
        RewardCurve,
        {"available": True, "points": [{"step": 1, "reward": 0.5, "samples": 2, "files": 1}]},
        "rewards",
    ),
    _answer(ErrorAnswer, {"error": "no node 00 in the ledger"}, "an error answer"),
]
IDS = [c.model.__name__ for c in CARRIERS]


# ----- walking the types --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    kind: str  # "float" or "str"
    path: tuple[Any, ...]  # keys and list indices from the carrier's top; "*" is a dict's first key
    bounded: tuple[bool, bool]  # (has a lower bound, has an upper bound)


def _bounds(metadata: list[Any]) -> tuple[bool, bool]:
    items = [m for x in metadata for m in (x.metadata if isinstance(x, FieldInfo) else [x])]
    low = any(isinstance(m, (annotated_types.Ge, annotated_types.Gt)) for m in items)
    high = any(isinstance(m, (annotated_types.Le, annotated_types.Lt)) for m in items)
    return low, high


def leaves(annotation: Any, path: tuple[Any, ...] = (), metadata: list[Any] | None = None) -> Iterator[Leaf]:
    metadata = metadata or []
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        yield from leaves(args[0], path, metadata + list(args[1:]))
    elif origin in (Union, types.UnionType):
        for arg in args:
            if arg is not type(None):
                yield from leaves(arg, path, metadata)
    elif origin in (list, tuple, set, frozenset):
        yield from leaves(args[0], (*path, 0))
    elif origin is dict:
        yield from leaves(args[1], (*path, "*"))
    elif origin is Literal:
        if all(isinstance(a, str) for a in args):
            yield Leaf("str", path, (False, False))
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for name, field in annotation.model_fields.items():
            yield from leaves(field.annotation, (*path, name), list(field.metadata))
    elif annotation is float:
        yield Leaf("float", path, _bounds(metadata))
    elif annotation is str:
        yield Leaf("str", path, (False, False))


def nested_models(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        for field in annotation.model_fields.values():
            yield from nested_models(field.annotation)
    for arg in get_args(annotation):
        yield from nested_models(arg)


def _all_subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _all_subclasses(sub)
    return found


def _place(document: Any, path: tuple[Any, ...], value: Any, model: type) -> Any:
    document = copy.deepcopy(document)
    holder = document
    for step in path[:-1]:
        holder = holder[next(iter(holder)) if step == "*" else step]
    last = next(iter(holder)) if path[-1] == "*" else path[-1]
    if isinstance(holder, dict) and last not in holder or isinstance(holder, list) and not holder:
        pytest.fail(f"the {model.__name__} sample leaves {'.'.join(map(str, path))} unset: fill it in")
    if holder[last] is None:
        pytest.fail(f"the {model.__name__} sample leaves {'.'.join(map(str, path))} null: give it a value")
    holder[last] = value
    return document


def _with_literal(document: dict[str, Any], path: tuple[Any, ...], literal: str, model: type) -> bytes:
    marker = "\x01fuzz\x01"
    return json.dumps(_place(document, path, marker, model)).replace(json.dumps(marker), literal).encode()


def _dotted(path: tuple[Any, ...], document: dict[str, Any]) -> str:
    parts, holder = [], document
    for step in path:
        key = next(iter(holder)) if step == "*" else step
        parts.append(str(key))
        holder = holder[key]
    return ".".join(parts)


def _names(message: str, where: str) -> bool:
    """Whether `message` names the field at dotted path `where`: whole (`at addresses.0:`), or as the field
    and its item (`at addresses: ... item 0 ...`, `at hardware: ... item 'cpu' ...`: how a check of a whole
    list or dict reports it)."""
    if re.search(rf"\b{re.escape(where)}\b", message):
        return True
    field, _, index = where.rpartition(".")
    item = f"item {index}" if index.isdigit() else f"item {index!r}"  # a list index, or a dict key
    return bool(re.search(rf"\b{re.escape(field)}\b", message)) and item in message


# ----- the tests ----------------------------------------------------------------------------------------


def test_every_wire_type_is_a_wire_model_reachable_from_a_carrier() -> None:
    for info in pkgutil.walk_packages(prime_node.p2p.__path__, "prime_node.p2p."):
        importlib.import_module(info.name)
    defined = {
        cls
        for module in list(importlib.sys.modules.values())
        if getattr(module, "__name__", "").startswith("prime_node.p2p")
        for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, BaseModel) and cls.__module__ == module.__name__
    }
    stray = sorted(
        c.__qualname__ for c in defined if not issubclass(c, WireModel) and not issubclass(c, LOCAL_TYPES)
    )
    assert not stray, f"pydantic models in the wire package that are not WireModels: {stray}"
    reachable = {m for carrier in CARRIERS for m in nested_models(carrier.model)}
    # A type without fields (a base such as verdicts._Document) is never parsed on its own.
    unreached = sorted(c.__qualname__ for c in _all_subclasses(WireModel) - reachable if c.model_fields)
    assert not unreached, f"wire types no carrier reaches (add a Carrier with a sample): {unreached}"
    floats = {
        (c.model.__name__, ".".join(map(str, leaf.path)))
        for c in CARRIERS
        for leaf in leaves(c.model)
        if leaf.kind == "float"
    }
    # The walk finds fields at every depth (a sanity check of the walker, not the list of what is fuzzed).
    assert {
        ("Heartbeat", "sent_at"),
        ("PolicyAnnouncement", "run.temperature"),
        ("Receipt", "body.received_at"),
        ("BanRecord", "until"),
        ("NodeDetail", "node.score"),
    } <= floats


def _forgeries_refused(carrier: Carrier, raw: bytes) -> None:
    for forged in carrier.forged:
        with pytest.raises(carrier.error):
            forged(raw)


@pytest.mark.parametrize(
    "carrier", [c for c in CARRIERS if c.forged], ids=[c.model.__name__ for c in CARRIERS if c.forged]
)
def test_forgeries_of_an_honest_sample_are_refused(carrier: Carrier) -> None:
    """The forgeries the fuzz sends are refused for their signature alone (an honest sample, forged)."""
    carrier.parse(json.dumps(carrier.sample).encode())  # the honest control
    _forgeries_refused(carrier, json.dumps(carrier.sample).encode())


@pytest.mark.parametrize("carrier", CARRIERS, ids=IDS)
def test_every_float_of_every_wire_type_must_be_finite(carrier: Carrier) -> None:
    carrier.parse(json.dumps(carrier.sample).encode())  # the honest control: the sample itself passes
    fuzzed = 0
    for leaf in leaves(carrier.model):
        if leaf.kind != "float":
            continue
        where = _dotted(leaf.path, carrier.sample)
        literals = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]
        literals += ["-1e308"] * leaf.bounded[0] + ["1e308"] * leaf.bounded[1]
        for literal in literals:
            raw = _with_literal(carrier.sample, leaf.path, literal, carrier.model)
            with pytest.raises(carrier.error) as refused:
                carrier.parse(raw)
            assert _names(str(refused.value), where), (literal, str(refused.value))
            _forgeries_refused(carrier, raw)
            fuzzed += 1
    assert fuzzed or not any(leaf.kind == "float" for leaf in leaves(carrier.model))


@pytest.mark.parametrize("carrier", CARRIERS, ids=IDS)
def test_every_string_of_every_wire_type_refuses_control_characters(carrier: Carrier) -> None:
    carrier.parse(json.dumps(carrier.sample).encode())
    for leaf in leaves(carrier.model):
        if leaf.kind != "str":
            continue
        where = _dotted(leaf.path, carrier.sample)
        holder = carrier.sample
        for step in leaf.path:
            holder = holder[next(iter(holder)) if step == "*" else step]
        for char in BAD_CHARS:
            for value in (holder + char, holder[:1] + char + holder[1:]):  # a trailing "\n" is the classic
                raw = json.dumps(_place(carrier.sample, leaf.path, value, carrier.model)).encode()
                with pytest.raises(carrier.error) as refused:
                    carrier.parse(raw)
                assert _names(str(refused.value), where), (value, str(refused.value))
                _forgeries_refused(carrier, raw)


@pytest.mark.parametrize("expiration", [float("nan"), float("inf"), float("-inf"), 1e308])
def test_dht_expiration_must_be_finite_and_bounded(expiration: float) -> None:
    validator = SwarmRecordValidator(RUN, [OPERATOR.node_id])
    body = Ban(node_id=NODE.node_id, reason="fraud", banned_at=T)
    kid, subkey = key_id(RUN, RecordKind.BAN), MSGPackSerializer.dumps(NODE.node_id)

    def record(when: float) -> DHTRecord:
        value = seal(OPERATOR, RUN, RecordKind.BAN, NODE.node_id, body, when)
        return DHTRecord(kid, subkey, MSGPackSerializer.dumps(value), when)

    assert validator.validate(record(get_dht_time() + 60))  # the honest control, signed alike
    with pytest.raises(RecordError, match="expiration"):
        validator.check(record(expiration))
    assert not validator.validate(record(expiration))


def test_pydantic_patterns_end_at_the_end_of_the_text() -> None:
    # pydantic matches `pattern` with Rust's regex crate, whose $ (without the m flag) is the very end of the
    # text; Python's re would take "run\n" here. Pinned, since a pattern Rust cannot compile (a lookaround)
    # silently falls back to Python's re.
    run_id = TypeAdapter(Annotated[str, FieldInfo(pattern=RUN_ID_PATTERN)])
    assert run_id.validate_python("run") == "run"
    assert re.match(RUN_ID_PATTERN, "run\n")  # what Python's re.match would have accepted
    for bad in ("run\n", "run\r\n", "run\x00"):
        with pytest.raises(ValidationError):
            run_id.validate_python(bad)


def test_no_python_regex_relies_on_dollar() -> None:
    # Python's `$` also matches before a final newline: re.match(r"^[a-z.]+$", "config.json\n") succeeds.
    # Names are matched with fullmatch (or \Z); `$` in a Python regex literal is refused here, everywhere.
    root = Path(prime_node.p2p.__file__).parent.parent
    found = []
    for package in ("p2p", "node", "proofs", "trainer"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "re"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                    and re.search(r"(?<!\\)\$", node.args[0].value)
                ):
                    found.append(
                        f"{path.relative_to(root)}:{node.lineno} re.{node.func.attr}({node.args[0].value!r})"
                    )
    assert not found, f"use fullmatch (or \\Z) instead of $ in: {found}"


@pytest.mark.parametrize("make", [_fraud_report, _partial_report], ids=["FraudReport", "PartialReport"])
def test_a_reports_body_read_field_by_field_refuses_every_cut_and_flip_by_name(
    make: Callable[[], Carrier],
) -> None:
    """The report reader parses its body a field at a time (the claim first, proofs/pipeline/reports.py): any
    prefix of an honest body, and any byte of it changed, is read or refused with RolloutFileError, nothing else;
    fields out of order, an extra one, and a stranger's signature over anything are refused."""
    carrier = make()
    honest = json.dumps(carrier.sample).encode()
    carrier.parse(honest)
    rng = random.Random(22)
    for cut in range(0, len(honest), max(1, len(honest) // 120)):
        with pytest.raises(RolloutFileError):
            carrier.parse(honest[:cut])
    for _ in range(300):
        flipped = bytearray(honest)
        flipped[rng.randrange(len(flipped))] = rng.choice(b'{}[]",:\\ 0aZ=+/\x00\xff')
        try:
            carrier.parse(bytes(flipped))
        except RolloutFileError:
            pass
    reordered = dict(reversed(list(carrier.sample.items())))
    with pytest.raises(RolloutFileError, match="does not hold 'claim' as its field 1"):
        carrier.parse(json.dumps(reordered).encode())
    with pytest.raises(RolloutFileError, match="holds more than its"):
        carrier.parse(json.dumps({**carrier.sample, "zzz": 1}).encode())
    for forged in carrier.forged:
        with pytest.raises(RolloutFileError):
            forged(honest)
