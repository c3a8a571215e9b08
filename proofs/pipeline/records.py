"""What each stage of a pipelined group hands the validator: its two streams' headers and the batch's tokens.

A stage's record holds the stream it received (the previous stage's opening and frame headers, with that
stage's signature over the chain head: the receiver cannot alter it) and the stream it sent (its own, signed
by itself), plus the output tokens of every sample. Tensors are not kept: the headers carry each frame's
SHA-256 and TOPLOC commitment, which is what the validator compares (docs/pipeline.md, "Trust").
The record is signed by its own node, so no member can write another's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, ValidationError

from ...p2p.errors import SignatureError, UnsignableDocument
from ...p2p.identity import Identity
from ...p2p.pipeline.frames import (
    PROTOCOL,
    ChainReader,
    Frame,
    FrameHeader,
    FrameShapes,
    SignatureHex,
    StreamOpening,
    tensor_bytes,
)
from ...p2p.pipeline.group_ids import group_id_of
from ...p2p.pipeline.layout import StageLayout, layout_digest
from ...p2p.signing import canonical_json, is_valid_signature
from ...p2p.wire import NodeId, Sha256Hex, WireFormatError, WireModel, describe, loads_strict
from ..errors import ProofError

_SIGNATURE = re.compile(r"[0-9a-f]{128}")
RECORD_DOMAIN = b"prime-node/pipeline-stage-record/v1\x00"
MAX_RECORD_FRAMES = 1 << 16
MAX_SAMPLES = 4096
MAX_OUTPUT_TOKENS = 8192


@dataclass(frozen=True)
class GroupSpec:
    """Who runs which stage of which batch (what a signed group record names)."""

    run_id: str
    policy_step: int
    batch: int
    layout: StageLayout
    members: tuple[str, ...]  # node ids in stage order
    nonce: str  # the formation nonce the group record carries (p2p/pipeline/group_ids.py): part of the id

    @property
    def group_id(self) -> str:
        return group_id_of(
            self.run_id, self.policy_step, self.members, layout_digest(self.layout), self.nonce
        )

    def opening(self, stage: int) -> StreamOpening:
        return StreamOpening(
            protocol=PROTOCOL,
            run_id=self.run_id,
            group=self.group_id,
            policy_step=self.policy_step,
            batch=self.batch,
            stage=stage,
            stages=self.layout.stages,
            sender=self.members[stage],
        )

    def reader(self, stage: int, shapes: FrameShapes | None = None) -> ChainReader:
        """The reader of the stream `stage` receives: it refuses any opening but its predecessor's exact one, and
        with `shapes` (the batch's schedule) any frame declaring another shape before its tensor is read."""
        sender = (stage - 1) % self.layout.stages
        return ChainReader(self.members[sender], self.layout, expected=self.opening(sender), shapes=shapes)


class HopRecord(WireModel):
    """One stream as its receiver or sender holds it."""

    opening: StreamOpening
    headers: list[FrameHeader] = Field(max_length=MAX_RECORD_FRAMES)
    head: Sha256Hex  # chain head after the last header
    # the stream sender's signature over head_message(opening digest, len(headers), head)
    signature: SignatureHex


class StageRecord(WireModel):
    stage: int = Field(ge=0)
    node_id: NodeId
    received: HopRecord  # from stage - 1 (stage 0: the last stage's tokens stream)
    sent: HopRecord  # to stage + 1 (the last stage: its tokens stream to stage 0)
    outputs: list[list[Annotated[int, Field(ge=0, lt=1 << 31)]]] = Field(max_length=MAX_SAMPLES)


class SignedStageRecord(WireModel):
    record: StageRecord
    signature: SignatureHex  # record.node_id's signature over RECORD_DOMAIN || canonical JSON of record

    @classmethod
    def sign(cls, record: StageRecord, identity: Identity) -> SignedStageRecord:
        payload = RECORD_DOMAIN + canonical_json(record.model_dump(mode="json"))
        return cls(record=record, signature=identity.sign(payload).hex())

    def is_authentic(self) -> bool:
        payload = RECORD_DOMAIN + canonical_json(self.record.model_dump(mode="json"))
        return is_valid_signature(self.record.node_id, payload, bytes.fromhex(self.signature))


@dataclass(frozen=True)
class HopFraud:
    """A receiver's evidence that its predecessor signed a frame whose commitment its own tensor belies: the
    stream up to that frame (signed by the sender through the chain) and the frame's tensor bytes."""

    hop: HopRecord  # headers up to and including the bad frame; head and signature after it
    tensor: bytes  # the bad frame's raw tensor bytes (they hash to its signed tensor_sha256)

    @classmethod
    def of(cls, hop: HopRecord, frame: Frame) -> HopFraud:
        headers = [*hop.headers, frame.header]
        return cls(
            hop=hop.model_copy(
                update={"headers": headers, "head": frame.head.hex(), "signature": frame.signature.hex()}
            ),
            tensor=tensor_bytes(frame.tensor, frame.header.dtype),
        )


MAX_RECORD_BYTES = 64 << 20  # a stage record of a large batch (headers with TOPLOC commitments) fits


class StageRecordError(ProofError):
    """A stage record that is oversized, not strict JSON, not signed by the member it should be, or malformed."""


def parse_stage_record(raw: bytes, member: str, *, max_bytes: int = MAX_RECORD_BYTES) -> SignedStageRecord:
    """A stage's record as the validator receives it: size bounded first, then the member's signature checked
    over the record's canonical JSON while looking at nothing but the two top-level keys, then the schema."""
    if len(raw) > max_bytes:
        raise StageRecordError(f"stage record is {len(raw)} bytes; at most {max_bytes}")
    try:
        document = loads_strict(raw, "stage record")
    except WireFormatError as exc:
        raise StageRecordError(f"stage record is not strict JSON: {exc}") from None
    if not isinstance(document, dict) or set(document) != {"record", "signature"}:
        raise StageRecordError("stage record must be an object with exactly 'record' and 'signature'")
    try:  # a text without a UTF-8 form (a lone surrogate) has no canonical JSON: named, and never verified
        canonical_json(document)
    except UnsignableDocument as exc:
        raise StageRecordError(f"stage record cannot be verified: {exc}") from None
    signature = document["signature"]
    if not isinstance(signature, str) or _SIGNATURE.fullmatch(signature) is None:
        raise StageRecordError("stage record is malformed at signature: not 128 lowercase hex digits")
    try:
        signed = bytes.fromhex(signature)
        payload = RECORD_DOMAIN + canonical_json(document["record"])
    except (ValueError, SignatureError):
        signed, payload = b"", b""
    if not payload or not is_valid_signature(member, payload, signed):
        raise StageRecordError("stage record is not signed by the member of its stage")
    try:
        return SignedStageRecord.model_validate(document)
    except ValidationError as exc:
        raise StageRecordError(f"stage record is malformed {describe(exc)}") from None
