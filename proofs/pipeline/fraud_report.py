"""A receiver's evidence that its predecessor sent a frame whose commitment the frame's own tensor belies.

When a stage finds such a frame (node/pipeline/stage.py CommitmentMismatch), the batch is abandoned and no
stage file is written; the receiver hands the validator this report instead (envelope v3 of kind `fraud`,
routed with its group's batch). The body is one JSON object:

    {"run_id", "policy_step", "batch", "members": [node ids in stage order], "prompts", "micro_batch_size",
     "hop": HopRecord (the accused's stream up to and including the bad frame, under its signature),
     "tensor": base64 of the bad frame's raw tensor bytes}

It proves something only through the accused's own signature: the chain head of `hop` is signed by the stream's
sender, the frame's header signs `tensor_sha256`, and the tensor is the one it names (check_fraud,
proofs/pipeline/blame.py). A report of a frame whose commitment does match proves nothing and is its reporter's
fault. The reader bounds the size before parsing, checks the envelope's signature first, then the schema (a
one-line error naming the field), that the envelope's group is these members' and that the reporter is the
hop's receiver.
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
from .records import MAX_SAMPLES, HopFraud, HopRecord, group_id_of

MAX_REPORT_BYTES = MAX_TENSOR_BYTES * 4 // 3 + (16 << 20)  # the tensor in base64, and the stream's headers
Base64 = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9+/]*={0,2}$", max_length=MAX_TENSOR_BYTES * 4 // 3 + 4)
]


class FraudReport(WireModel):
    run_id: str = Field(min_length=1, max_length=128)
    policy_step: int = Field(ge=0, lt=1 << 63)
    batch: int = Field(ge=0, lt=1 << 63)
    members: list[NodeId] = Field(min_length=2, max_length=MAX_STAGES)  # the group in stage order
    prompts: int = Field(ge=1, le=MAX_SAMPLES)  # problems in the batch: with the group, its assigned work
    micro_batch_size: int = Field(ge=1, le=MAX_SAMPLES)
    hop: HopRecord  # the accused's stream, up to and including the frame its tensor belies
    tensor: Base64  # that frame's raw tensor bytes

    @property
    def group_id(self) -> str:
        return group_id_of(self.run_id, self.policy_step, self.members)

    def evidence(self) -> HopFraud:
        return HopFraud(self.hop, base64.b64decode(self.tensor, validate=True))


@dataclass(frozen=True)
class ReceivedReport:
    report: FraudReport
    signer: str  # the reporter: the hop's receiver
    sha256: str


def write_fraud_report(path: Path, report: FraudReport, identity: Identity) -> Path:
    """Write the report and its v3 envelope (kind `fraud`) beside it; returns the envelope's path."""
    data = json.dumps(report.model_dump(mode="json"), sort_keys=True).encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    sig_path = signature_path(path)
    envelope = sign_bytes(
        data, identity, batch=(report.policy_step, report.batch), group=report.group_id, kind="fraud"
    )
    write_atomic(sig_path, json.dumps(envelope, sort_keys=True).encode() + b"\n")
    return sig_path


def report_of(
    fraud: HopFraud, *, run_id: str, members: tuple[str, ...], prompts: int, micro_batch_size: int
) -> FraudReport:
    opening = fraud.hop.opening
    return FraudReport(
        run_id=run_id,
        policy_step=opening.policy_step,
        batch=opening.batch,
        members=list(members),
        prompts=prompts,
        micro_batch_size=micro_batch_size,
        hop=fraud.hop,
        tensor=base64.b64encode(fraud.tensor).decode(),
    )


def _bad(message: str) -> RolloutFileError:
    return RolloutFileError(f"fraud report {message}", check="bounds")


def read_fraud_report(path: Path, expected_signer: str | None = None) -> ReceivedReport:
    """A fraud report as the validator reads it; RolloutFileError naming the check (and the field)."""
    path = Path(path)
    envelope = parse_envelope(read_bounded(signature_path(path), MAX_SIG_BYTES, "signature file"))
    group = envelope_group(envelope)
    if group is None or envelope["kind"] != "fraud":
        raise RolloutFileError(
            f"a fraud report is signed as {SIG_FORMAT_STAGE} of kind 'fraud', not {envelope['format']}",
            check="signature",
        )
    data = read_bounded(path, MAX_REPORT_BYTES, "fraud report")
    signer = verify_envelope(data, envelope, expected_signer)
    try:
        report = FraudReport.model_validate(loads_strict(data, "fraud report"))
        report.evidence()
    except WireFormatError as exc:
        raise _bad(f"is not strict JSON: {exc}") from None
    except ValidationError as exc:
        raise _bad(f"is malformed {describe(exc)}") from None
    except (binascii.Error, ValueError) as exc:
        raise _bad(f"is malformed at tensor: {exc}") from None
    if report.group_id != group or envelope_batch(envelope) != (report.policy_step, report.batch):
        raise RolloutFileError(
            "the envelope signs another group or batch than the report names", check="signer"
        )
    receiver = (report.hop.opening.stage + 1) % len(report.members)
    if report.hop.opening.stage >= len(report.members) or report.members[receiver] != signer:
        raise RolloutFileError(
            "the report's signer is not the receiver of the stream it accuses", check="signer"
        )
    return ReceivedReport(report, signer, envelope["sha256"])
