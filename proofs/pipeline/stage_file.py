"""A pipeline stage's rollout file (format prime-node/rollout/v4): what one member of a group hands a validator.

Every stage of a group writes one, signed by its own node (envelope prime-node/rollout-sig/v3, which signs the
group too, so the group's files are routed to one validator). Every stage's file holds the same rows: the
group's assignment (proofs/assignment.py, keyed by the group id, so no member chose it), the output tokens and
the rewards, in the columns of a rollout file (proofs/rollout_schema.py SCHEMA). The last stage's file carries
today's proofs in `proof` (TOPLOC commitments of the final hidden states, 258 bytes per 32 tokens); the other
stages' `proof` is empty. Then the stage record (proofs/pipeline/records.py) as columns:

    group_members     string   node ids of the group in stage order, comma-separated (shared by every row)
    stage             int32    this file's stage (shared)
    micro_batch_size  int32    the batch's micro-batch cut, which every member and the validator derive (shared)
    received_stream   binary   row 0: canonical JSON of the stream this stage received (HopRecord: the
                               predecessor's opening, frame headers with their TOPLOC commitments, chain head and
                               the predecessor's signature); null in every other row
    sent_stream       binary   row 0: the same for the stream this stage sent; null in every other row
    stage_signature   string   this node's signature over the stage record (RECORD_DOMAIN, records.py) (shared)
    layout_sha256     string   the digest of the stage layout the group ran under (p2p/pipeline/layout.py
                               layout_digest), part of the group id the envelope signs (shared)
    group_nonce       string   the group record's formation nonce (p2p/pipeline/group_ids.py), part of the group
                               id the envelope signs (shared). New in v4: v3 files had no nonce

The streams are held once, in row 0, so that a large record is not repeated per row. A reader checks the
envelope's signature before Parquet is parsed, the layout and every column's bytes before decoding (as for
rollout files), then each stage column with a one-line error naming it, and that the record signature is the
file's signer's over the record rebuilt from the columns and the rows' output tokens.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from ...p2p.errors import UnsignableDocument
from ...p2p.identity import Identity
from ...p2p.pipeline.group_ids import NONCE_DIGITS, group_id_of, is_nonce
from ...p2p.pipeline.layout import MAX_STAGES
from ...p2p.signing import canonical_json
from ...p2p.wire import WireFormatError, describe, is_hex64, loads_strict
from ..rollout_decode import decode_columns
from ..rollout_file import (
    MAX_SIG_BYTES,
    SIG_FORMAT_STAGE,
    batch_of,
    check_signer,
    envelope_batch,
    envelope_group,
    parse_envelope,
    read_bounded,
    sign_bytes,
    signature_path,
    verify_envelope,
    write_atomic,
)
from ..rollout_layout import check_layout, read_layout
from ..rollout_schema import (
    COLUMNS,
    FORMAT_KEY,
    SCHEMA,
    RolloutFileError,
    RolloutLimits,
    RolloutRow,
    check_rows,
)
from .records import HopRecord, SignedStageRecord, StageRecord

STAGE_FORMAT = "prime-node/rollout/v4"
MAX_STREAM_BYTES = 24 << 20  # one stream's canonical JSON: ~700 bytes a frame header, some 35,000 frames
STAGE_COLUMNS = (
    "group_members",
    "stage",
    "micro_batch_size",
    "received_stream",
    "sent_stream",
    "stage_signature",
    "layout_sha256",
    "group_nonce",
)
STAGE_SCHEMA = pa.schema(
    [
        *SCHEMA,
        pa.field("group_members", pa.string(), nullable=False),
        pa.field("stage", pa.int32(), nullable=False),
        pa.field("micro_batch_size", pa.int32(), nullable=False),
        pa.field("received_stream", pa.binary(), nullable=True),
        pa.field("sent_stream", pa.binary(), nullable=True),
        pa.field("stage_signature", pa.string(), nullable=False),
        pa.field("layout_sha256", pa.string(), nullable=False),
        pa.field("group_nonce", pa.string(), nullable=False),
    ],
    metadata={FORMAT_KEY: STAGE_FORMAT.encode()},
)
# Longest value of each binary stage column, checked on the pages and the dictionaries before decoding.
STAGE_LIMITS = {
    "group_members": MAX_STAGES * 65,
    "received_stream": MAX_STREAM_BYTES,
    "sent_stream": MAX_STREAM_BYTES,
    "stage_signature": 128,
    "layout_sha256": 64,
    "group_nonce": NONCE_DIGITS,
}
_SHARED = ("group_members", "stage", "micro_batch_size", "stage_signature", "layout_sha256", "group_nonce")
_SIGNATURE = re.compile(r"[0-9a-f]{128}")


@dataclass(frozen=True)
class StageFile:
    """A verified, parsed stage file."""

    path: Path
    sha256: str
    signer: str  # the stage's node: signed the envelope and the record, named by every row
    # the group the envelope signs; the digest of run, step, `members`, the layout's digest and `nonce`
    group_id: str
    members: tuple[str, ...]  # the group in stage order
    nonce: str  # the group's formation nonce (its record's)
    micro_batch_size: int
    rows: tuple[RolloutRow, ...]
    record: SignedStageRecord  # rebuilt from the columns and the rows' tokens, its signature checked

    @property
    def stage(self) -> int:
        return self.record.record.stage

    @property
    def batch(self) -> tuple[int, int]:
        return batch_of(list(self.rows))

    @property
    def last(self) -> bool:
        """Whether this is the group's last stage: its file is the one whose rows an accepted group trains on."""
        return self.stage == len(self.members) - 1


def _bad(column: str, message: str) -> RolloutFileError:
    return RolloutFileError(f"column {column!r}: {message}", check="bounds")


def encode_stage_rows(
    rows: list[RolloutRow],
    members: tuple[str, ...],
    layout_sha256: str,
    nonce: str,
    micro_batch_size: int,
    signed: SignedStageRecord,
) -> bytes:
    record = signed.record
    streams = {
        "received_stream": canonical_json(record.received.model_dump(mode="json")),
        "sent_stream": canonical_json(record.sent.model_dump(mode="json")),
    }
    table_rows: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        values = row.to_record()
        values.update(
            group_members=",".join(members),
            stage=record.stage,
            micro_batch_size=micro_batch_size,
            stage_signature=signed.signature,
            layout_sha256=layout_sha256,
            group_nonce=nonce,
        )
        for name, raw in streams.items():
            values[name] = raw if i == 0 else None
        table_rows.append(values)
    table = pa.Table.from_pylist(table_rows, schema=STAGE_SCHEMA)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def write_stage_file(
    path: Path,
    rows: list[RolloutRow],
    identity: Identity,
    *,
    members: tuple[str, ...],
    layout_sha256: str,
    nonce: str,
    micro_batch_size: int,
    signed: SignedStageRecord,
    limits: RolloutLimits | None = None,
) -> Path:
    """Write a stage's file and its v3 envelope beside it; returns the envelope's path. The file is checked with
    the reader's own rules first, so a member never publishes what an honest validator would call malformed."""
    limits = limits or RolloutLimits()
    data = encode_stage_rows(rows, members, layout_sha256, nonce, micro_batch_size, signed)
    group = group_id_of(rows[0].run_id, rows[0].policy_step, members, layout_sha256, nonce) if rows else ""
    _check(data, identity.node_id, group, batch_of(rows) if rows else None, limits)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    sig_path = signature_path(path)
    envelope = sign_bytes(data, identity, batch=batch_of(rows), group=group)
    write_atomic(sig_path, json.dumps(envelope, sort_keys=True).encode() + b"\n")
    return sig_path


def read_stage_file(
    path: Path, limits: RolloutLimits | None = None, expected_signer: str | None = None
) -> StageFile:
    """Read and fully check a stage file and its envelope; RolloutFileError naming the check (and the column)."""
    limits = limits or RolloutLimits()
    path = Path(path)
    envelope = parse_envelope(read_bounded(signature_path(path), MAX_SIG_BYTES, "signature file"))
    group = envelope_group(envelope)
    if group is None or envelope["kind"] != "stage":
        what = "a rollout file's" if group is None else f"a group's {envelope['kind']} file's"
        raise RolloutFileError(
            f"signature format {envelope['format']} is {what}; a stage file is signed as {SIG_FORMAT_STAGE} "
            "of kind 'stage'",
            check="signature",
        )
    data = read_bounded(path, limits.max_file_bytes, "stage file")
    signer = verify_envelope(data, envelope, expected_signer)
    return _check(data, signer, group, envelope_batch(envelope), limits, path, envelope["sha256"])


def _check(
    data: bytes,
    signer: str,
    group: str,
    batch: tuple[int, int] | None,
    limits: RolloutLimits,
    path: Path = Path(""),
    sha256: str = "",
) -> StageFile:
    parquet, layout = read_layout(data, STAGE_SCHEMA)
    check_layout(layout, limits, STAGE_LIMITS)
    values = decode_columns(parquet, layout, limits, STAGE_SCHEMA, STAGE_LIMITS)
    rows = [
        RolloutRow(**dict(zip(COLUMNS, fields, strict=True))) for fields in zip(*(values[c] for c in COLUMNS))
    ]
    for name in _SHARED:
        column = values[name]
        differs = next((i for i, v in enumerate(column) if v != column[0]), None)
        if differs is not None:
            raise _bad(name, f"row {differs} differs from row 0 (every row holds the same)")
    members = _members(values["group_members"][0])
    stage = values["stage"][0]
    if not 0 <= stage < len(members):
        raise _bad("stage", f"{stage} is outside the group's {len(members)} stages")
    micro = values["micro_batch_size"][0]
    if not 1 <= micro <= limits.max_rows:
        raise _bad("micro_batch_size", f"{micro} is outside [1, {limits.max_rows}]")
    layout_sha256 = values["layout_sha256"][0]
    if not is_hex64(layout_sha256):
        raise _bad("layout_sha256", "not 64 lowercase hex digits")
    nonce = values["group_nonce"][0]
    if not is_nonce(nonce):
        raise _bad(
            "group_nonce", f"not {NONCE_DIGITS} lowercase hex digits (a group record's formation nonce)"
        )
    check_rows(rows, limits, proof=stage == len(members) - 1)
    try:  # rows that are not the signer's, or another batch than its envelope routed: fraud, as for rollout files
        check_signer(rows, signer, batch)
    except RolloutFileError as exc:
        raise RolloutFileError(str(exc), check="signer") from None
    if members[stage] != signer:
        raise RolloutFileError(
            f"column 'group_members': stage {stage}'s member is not the file's signer", check="signer"
        )
    if group_id_of(rows[0].run_id, rows[0].policy_step, members, layout_sha256, nonce) != group:
        raise RolloutFileError(
            "the envelope signs another group than the file's members, run, policy step, layout and nonce make",
            check="signer",
        )
    streams = [_stream(name, values[name]) for name in ("received_stream", "sent_stream")]
    signature = values["stage_signature"][0]
    if not isinstance(signature, str) or _SIGNATURE.fullmatch(signature) is None:
        raise _bad("stage_signature", "not 128 lowercase hex digits")
    try:
        record = StageRecord(
            stage=stage,
            node_id=signer,
            received=streams[0],
            sent=streams[1],
            outputs=[list(r.output_ids) for r in rows],
        )
    except ValidationError as exc:
        raise RolloutFileError(f"the stage record is malformed {describe(exc)}", check="bounds") from None
    signed = SignedStageRecord(record=record, signature=signature)
    if not signed.is_authentic():
        raise _bad("stage_signature", "not the signer's signature over the stage record these columns hold")
    return StageFile(path, sha256, signer, group, members, nonce, micro, tuple(rows), signed)


def _members(text: str) -> tuple[str, ...]:
    members = tuple(text.split(","))
    if not 2 <= len(members) <= MAX_STAGES:
        raise _bad("group_members", f"{len(members)} members; a group has 2..{MAX_STAGES}")
    if not all(is_hex64(m) for m in members):
        raise _bad("group_members", "a member is not a node id (64 lowercase hex digits)")
    if len(set(members)) != len(members):
        raise _bad("group_members", "a node holds two stages")
    return members


def _stream(column: str, cells: list[Any]) -> HopRecord:
    raw = cells[0]
    if raw is None or any(c is not None for c in cells[1:]):
        raise _bad(column, "row 0 holds the stream and every other row holds null")
    try:
        document = loads_strict(raw, column)
        hop = HopRecord.model_validate(document)
    except WireFormatError as exc:
        raise _bad(column, f"not strict JSON: {exc}") from None
    except ValidationError as exc:
        raise _bad(column, f"malformed {describe(exc)}") from None
    try:
        canonical = canonical_json(hop.model_dump(mode="json"))
    except UnsignableDocument as exc:
        raise _bad(column, f"cannot be verified: {exc}") from None
    if canonical != raw:
        raise _bad(column, "not the canonical JSON of the stream it holds")
    return hop
