"""What a member hands the validator when its group's batch did not finish: fraud evidence, or its partial record.

**Fraud report** (envelope v3 of kind `fraud`): when a stage finds a frame whose signed commitment the frame's
own tensor belies (node/pipeline/stage.py CommitmentMismatch), the batch is abandoned and the receiver hands in
the evidence: the accused's stream up to and including the bad frame (under its signature) and the frame's raw
tensor bytes (base64). It proves something only through the accused's own signature (check_fraud,
proofs/pipeline/blame.py); a report of a frame whose commitment does match proves nothing and is its reporter's
fault. Only the stream's receiver may report it.

**Partial record** (kind `partial`): when a batch breaks over a frame the schedule does not call for
(node/pipeline/errors.py BatchBroken), every member hands in its stage record as it stood: the streams received
and sent so far, each prefix signed by its sender, and the tokens it knows; proofs/pipeline/broken.py names the
stage whose own output deviates from its input, if one provably did. Signed by the record's member.

Both bodies are one JSON object holding the batch claim (run id, policy step, batch, members in stage order,
prompts and micro-batch size: with the group, the assigned work) and the evidence, its fields in sorted order
(the claim first, as the writer's sorted keys put them). The reader bounds the size, checks the envelope's
signature over the bytes, then reads the body one field at a time, each checked before the next, larger one is
parsed: the claim (at most 16 KiB), which the envelope must sign (the members' group, this batch) and whose
members must include the signer, so a stranger's report costs a hash and a 16 KiB parse, never its bulk; then
the evidence, with a one-line error naming the field. A fraud report's tensor is not decoded by the reader: its
base64 length must be the size the accused frame's header declares, and `ReceivedReport.evidence` decodes it
only once that header is the shape the batch's schedule calls for (p2p/pipeline/frames.py FrameShapes).
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, TypeVar

from pydantic import Field, StringConstraints, ValidationError

from ...p2p.identity import Identity
from ...p2p.pipeline.errors import PipelineWireError
from ...p2p.pipeline.frames import MAX_TENSOR_BYTES, FrameShapes, check_header
from ...p2p.pipeline.group_ids import GroupNonce, group_id_of
from ...p2p.pipeline.layout import MAX_STAGES, StageLayout, layout_digest
from ...p2p.wire import NodeId, Sha256Hex, WireFormatError, WireModel, loads_strict_prefix, printable
from ..rollout_file import (
    MAX_SIG_BYTES,
    SIG_FORMAT_STAGE,
    envelope_batch,
    envelope_group,
    parse_envelope,
    read_bounded,
    sign_bytes,
    signature_path,
    verify_envelope,
    write_atomic,
)
from ..rollout_schema import RolloutFileError
from .records import MAX_RECORD_BYTES, MAX_SAMPLES, HopFraud, HopRecord, SignedStageRecord

MAX_CLAIM_BYTES = 16 << 10  # a claim: up to 64 members of 64 hex digits, a run id, a few numbers
MAX_HOP_BYTES = 16 << 20  # the accused's stream up to the frame: its headers with their TOPLOC commitments
# The tensor in base64, the stream, the claim.
MAX_REPORT_BYTES = MAX_TENSOR_BYTES * 4 // 3 + MAX_HOP_BYTES + MAX_CLAIM_BYTES
_WS = rb"[ \t\n\r]*"  # JSON's whitespace
_OBJECT = re.compile(_WS + rb"\{")
_CLOSE = re.compile(_WS + rb"\}" + _WS)
_BASE64 = re.compile(rb'"([A-Za-z0-9+/]*={0,2})"')
Model = TypeVar("Model", bound=WireModel)
Base64 = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9+/]*={0,2}$", max_length=MAX_TENSOR_BYTES * 4 // 3 + 4)
]


class BatchClaim(WireModel):
    """Which batch of which group a report is about, and how it was cut."""

    run_id: str = Field(min_length=1, max_length=128)
    policy_step: int = Field(ge=0, lt=1 << 63)
    batch: int = Field(ge=0, lt=1 << 63)
    members: list[NodeId] = Field(min_length=2, max_length=MAX_STAGES)  # the group in stage order
    prompts: int = Field(ge=1, le=MAX_SAMPLES)  # problems in the batch: with the group, its assigned work
    micro_batch_size: int = Field(ge=1, le=MAX_SAMPLES)
    # The digest of the stage layout the group ran under (p2p/pipeline/layout.layout_digest): part of its id.
    layout_sha256: Sha256Hex
    # The group record's formation nonce (p2p/pipeline/group_ids.py): part of its id, like the layout's digest.
    nonce: GroupNonce

    @property
    def group_id(self) -> str:
        return group_id_of(self.run_id, self.policy_step, self.members, self.layout_sha256, self.nonce)


class FraudReport(WireModel):
    claim: BatchClaim
    hop: HopRecord  # the accused's stream, up to and including the frame its tensor belies
    tensor: Base64  # that frame's raw tensor bytes (the reader keeps it undecoded: ReceivedReport)


class PartialReport(WireModel):
    claim: BatchClaim
    record: (
        SignedStageRecord  # the member's stage record when the batch broke (partial streams, known tokens)
    )


@dataclass(frozen=True)
class ReceivedReport:
    """A fraud report as read: its claim and the accused's stream parsed, its tensor still base64."""

    claim: BatchClaim
    hop: HopRecord  # the accused's stream, up to and including the frame its tensor belies
    signer: str  # the reporter: the hop's receiver
    sha256: str
    tensor: memoryview = field(repr=False)  # base64 of exactly the size the accused frame's header declares

    def evidence(self, shapes: FrameShapes | None = None) -> HopFraud:
        """The evidence, its tensor decoded only once the accused frame's header is one `shapes` (the batch's
        schedule) calls for: PipelineWireError naming it otherwise; binascii.Error for base64 that is not."""
        if shapes is not None:
            shapes.check(self.hop.headers[-1])
        return HopFraud(self.hop, binascii.a2b_base64(self.tensor, strict_mode=True))


@dataclass(frozen=True)
class ReceivedPartial:
    report: PartialReport
    signer: str  # the record's member
    sha256: str

    @property
    def stage(self) -> int:
        return self.report.record.record.stage


def write_report(path: Path, report: FraudReport | PartialReport, identity: Identity) -> Path:
    """Write the report and its v3 envelope (kind `fraud` or `partial`) beside it; returns the envelope's path."""
    kind = "fraud" if isinstance(report, FraudReport) else "partial"
    data = json.dumps(report.model_dump(mode="json"), sort_keys=True).encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    sig_path = signature_path(path)
    claim = report.claim
    envelope = sign_bytes(
        data, identity, batch=(claim.policy_step, claim.batch), group=claim.group_id, kind=kind
    )
    write_atomic(sig_path, json.dumps(envelope, sort_keys=True).encode() + b"\n")
    return sig_path


def report_of(
    fraud: HopFraud, *, run_id: str, members: tuple[str, ...], layout: StageLayout, nonce: str
) -> FraudReport:
    opening = fraud.hop.opening
    claim = BatchClaim(
        run_id=run_id,
        policy_step=opening.policy_step,
        batch=opening.batch,
        members=list(members),
        prompts=layout.prompts,
        micro_batch_size=layout.micro_batch_size,
        layout_sha256=layout_digest(layout),
        nonce=nonce,
    )
    return FraudReport(
        claim=claim,
        hop=fraud.hop,
        tensor=base64.b64encode(fraud.tensor).decode(),
    )


def _bad(kind: str, message: str) -> RolloutFileError:
    return RolloutFileError(f"{kind} report {message}", check="bounds")


class _Body:
    """A report's JSON object read one top-level field at a time, in the order its writer's sorted keys put them,
    so that each is checked before the next (a larger one) is parsed; no field but those asked for, in that order."""

    def __init__(self, data: bytes, kind: str) -> None:
        opening = _OBJECT.match(data)
        if opening is None:
            raise _bad(kind, "is not a JSON object")
        self.data, self.kind, self.at, self.fields = data, kind, opening.end(), 0

    def _key(self, name: str) -> None:
        comma = _WS + rb"," if self.fields else b""
        key = re.compile(comma + _WS + b'"' + name.encode() + b'"' + _WS + b":" + _WS).match(
            self.data, self.at
        )
        if key is None:
            raise _bad(
                self.kind, f"does not hold {name!r} as its field {self.fields + 1} (fields in sorted order)"
            )
        self.at, self.fields = key.end(), self.fields + 1

    def value(self, name: str, model: type[Model], limit: int) -> Model:
        """The next field, `name`: strict JSON of at most `limit` bytes, of `model`'s schema."""
        self._key(name)
        head = self.data[self.at : self.at + limit]
        over = f" (or longer than its {limit}-byte bound)" if len(head) == limit else ""
        try:  # an incremental decoder: a cut through a multi-byte character at `limit` is not an error
            text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
            document, end = loads_strict_prefix(text, f"{self.kind} report's {name}")
        except UnicodeDecodeError as exc:
            raise _bad(self.kind, f"is not UTF-8 at {name}: {exc.reason}") from None
        except WireFormatError as exc:
            raise _bad(self.kind, f"is not strict JSON at {name}{over}: {exc}") from None
        self.at += len(text[:end].encode())
        try:
            return model.model_validate(document)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join([name, *(printable(str(part))[:40] for part in first["loc"])])
            raise _bad(self.kind, f"is malformed at {where}: {first['msg']}") from None

    def base64(self, name: str) -> memoryview:
        """The next field, `name`: a base64 string, not decoded (a view of the body's bytes)."""
        self._key(name)
        string = _BASE64.match(self.data, self.at)
        if string is None:
            raise _bad(self.kind, f"is malformed at {name}: not a base64 string")
        self.at = string.end()
        return memoryview(self.data)[string.start(1) : string.end(1)]

    def close(self) -> None:
        if _CLOSE.fullmatch(self.data, self.at) is None:
            raise _bad(self.kind, f"holds more than its {self.fields} fields")


def _open(
    path: Path, kind: str, limit: int, expected_signer: str | None
) -> tuple[_Body, BatchClaim, str, str]:
    """The report at `path` of `kind`: its envelope's signature checked over the bytes, then only its claim parsed,
    which must be the envelope's group and batch and name the signer among the members. (The body, the claim's
    members, and the envelope's signer, which the claim's group id binds, are all the validator has to go by.)"""
    path = Path(path)
    envelope = parse_envelope(read_bounded(signature_path(path), MAX_SIG_BYTES, "signature file"))
    group = envelope_group(envelope)
    if group is None or envelope["kind"] != kind:
        raise RolloutFileError(
            f"a {kind} report is signed as {SIG_FORMAT_STAGE} of kind {kind!r}, not {envelope['format']} "
            f"of kind {envelope.get('kind')!r}",
            check="signature",
        )
    data = read_bounded(path, limit, f"{kind} report")
    signer = verify_envelope(data, envelope, expected_signer)
    body = _Body(data, kind)
    claim = body.value("claim", BatchClaim, MAX_CLAIM_BYTES)
    if claim.group_id != group or envelope_batch(envelope) != (claim.policy_step, claim.batch):
        raise RolloutFileError(
            "the envelope signs another group or batch than the report names", check="signer"
        )
    if signer not in claim.members:
        raise RolloutFileError(
            f"the {kind} report's signer is not a member of the group it names; the rest is not read",
            check="signer",
        )
    return body, claim, signer, envelope["sha256"]


def read_fraud_report(path: Path, expected_signer: str | None = None) -> ReceivedReport:
    """A fraud report as the validator reads it; RolloutFileError naming the check (and the field). The tensor's
    base64 length must be the size the accused frame's header declares; it is decoded only by `evidence`."""
    body, claim, signer, sha256 = _open(path, "fraud", MAX_REPORT_BYTES, expected_signer)
    hop = body.value("hop", HopRecord, MAX_HOP_BYTES)
    members = claim.members
    receiver = (hop.opening.stage + 1) % len(members)
    if hop.opening.stage >= len(members) or members[receiver] != signer:
        raise RolloutFileError(
            "the report's signer is not the receiver of the stream it accuses", check="signer"
        )
    if not hop.headers:
        raise _bad("fraud", "is malformed at hop.headers: no frame to accuse")
    header = hop.headers[-1]
    try:
        size = check_header(header, MAX_TENSOR_BYTES)
    except PipelineWireError as exc:
        raise _bad("fraud", f"is malformed at hop.headers: {exc}") from None
    tensor = body.base64("tensor")
    if len(tensor) != 4 * -(-size // 3):
        raise _bad(
            "fraud",
            f"is malformed at tensor: {len(tensor)} base64 characters, where frame {header.index} declares "
            f"{header.shape} {header.dtype} ({size} bytes)",
        )
    body.close()
    return ReceivedReport(claim, hop, signer, sha256, tensor)


def read_partial_report(path: Path, expected_signer: str | None = None) -> ReceivedPartial:
    """A member's partial record as the validator reads it: its own, for its own stage, signed by it."""
    body, claim, signer, sha256 = _open(
        path, "partial", MAX_RECORD_BYTES + MAX_CLAIM_BYTES + 64, expected_signer
    )
    signed = body.value("record", SignedStageRecord, MAX_RECORD_BYTES)
    body.close()
    record, members = signed.record, claim.members
    if record.node_id != signer or record.stage >= len(members) or members[record.stage] != signer:
        raise RolloutFileError(
            "the partial record is not its signer's, for its signer's stage", check="signer"
        )
    if not signed.is_authentic():
        raise _bad("partial", "is malformed at record.signature: not the member's signature over its record")
    return ReceivedPartial(PartialReport.model_construct(claim=claim, record=signed), signer, sha256)
