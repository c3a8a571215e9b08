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
prompts and micro-batch size: with the group, the assigned work) and the evidence. The reader bounds the size
before parsing, checks the envelope's signature first, then the schema (a one-line error naming the field), that
the envelope signs these members' group and this batch, and who may sign it.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field, StringConstraints, ValidationError

from ...p2p.identity import Identity
from ...p2p.pipeline.frames import MAX_TENSOR_BYTES
from ...p2p.pipeline.layout import MAX_STAGES
from ...p2p.wire import NodeId, WireFormatError, WireModel, describe, loads_strict
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
from .records import MAX_RECORD_BYTES, MAX_SAMPLES, HopFraud, HopRecord, SignedStageRecord, group_id_of

MAX_REPORT_BYTES = MAX_TENSOR_BYTES * 4 // 3 + (16 << 20)  # the tensor in base64, and the stream's headers
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

    @property
    def group_id(self) -> str:
        return group_id_of(self.run_id, self.policy_step, self.members)


class FraudReport(WireModel):
    claim: BatchClaim
    hop: HopRecord  # the accused's stream, up to and including the frame its tensor belies
    tensor: Base64  # that frame's raw tensor bytes

    def evidence(self) -> HopFraud:
        return HopFraud(self.hop, base64.b64decode(self.tensor, validate=True))


class PartialReport(WireModel):
    claim: BatchClaim
    record: (
        SignedStageRecord  # the member's stage record when the batch broke (partial streams, known tokens)
    )


@dataclass(frozen=True)
class ReceivedReport:
    report: FraudReport
    signer: str  # the reporter: the hop's receiver
    sha256: str


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
    fraud: HopFraud, *, run_id: str, members: tuple[str, ...], prompts: int, micro_batch_size: int
) -> FraudReport:
    opening = fraud.hop.opening
    claim = BatchClaim(
        run_id=run_id,
        policy_step=opening.policy_step,
        batch=opening.batch,
        members=list(members),
        prompts=prompts,
        micro_batch_size=micro_batch_size,
    )
    return FraudReport(
        claim=claim,
        hop=fraud.hop,
        tensor=base64.b64encode(fraud.tensor).decode(),
    )


def _bad(kind: str, message: str) -> RolloutFileError:
    return RolloutFileError(f"{kind} report {message}", check="bounds")


def _read(
    path: Path,
    kind: str,
    model: type[FraudReport] | type[PartialReport],
    limit: int,
    expected_signer: str | None,
) -> tuple[FraudReport | PartialReport, str, str]:
    """The report at `path` of `kind`, its envelope's signature checked before a byte of it is parsed."""
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
    try:
        report = model.model_validate(loads_strict(data, f"{kind} report"))
        if isinstance(report, FraudReport):
            report.evidence()
    except WireFormatError as exc:
        raise _bad(kind, f"is not strict JSON: {exc}") from None
    except ValidationError as exc:
        raise _bad(kind, f"is malformed {describe(exc)}") from None
    except (binascii.Error, ValueError) as exc:
        raise _bad(kind, f"is malformed at tensor: {exc}") from None
    claim = report.claim
    if claim.group_id != group or envelope_batch(envelope) != (claim.policy_step, claim.batch):
        raise RolloutFileError(
            "the envelope signs another group or batch than the report names", check="signer"
        )
    return report, signer, envelope["sha256"]


def read_fraud_report(path: Path, expected_signer: str | None = None) -> ReceivedReport:
    """A fraud report as the validator reads it; RolloutFileError naming the check (and the field)."""
    report, signer, sha256 = _read(path, "fraud", FraudReport, MAX_REPORT_BYTES, expected_signer)
    assert isinstance(report, FraudReport)
    members = report.claim.members
    receiver = (report.hop.opening.stage + 1) % len(members)
    if report.hop.opening.stage >= len(members) or members[receiver] != signer:
        raise RolloutFileError(
            "the report's signer is not the receiver of the stream it accuses", check="signer"
        )
    return ReceivedReport(report, signer, sha256)


def read_partial_report(path: Path, expected_signer: str | None = None) -> ReceivedPartial:
    """A member's partial record as the validator reads it: its own, for its own stage, signed by it."""
    report, signer, sha256 = _read(path, "partial", PartialReport, MAX_RECORD_BYTES + 4096, expected_signer)
    assert isinstance(report, PartialReport)
    record, members = report.record.record, report.claim.members
    if record.node_id != signer or record.stage >= len(members) or members[record.stage] != signer:
        raise RolloutFileError(
            "the partial record is not its signer's, for its signer's stage", check="signer"
        )
    if not report.record.is_authentic():
        raise _bad("partial", "is malformed at record.signature: not the member's signature over its record")
    return ReceivedPartial(report, signer, sha256)
