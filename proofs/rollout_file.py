"""Writing, signing and reading rollout files (Parquet + a detached signature envelope).

`FILE.parquet` travels with `FILE.parquet.sig`, a small JSON envelope signed by the producing node:

    {"format": "prime-node/rollout-sig/v2", "node_id": HEX, "sha256": HEX, "size": N,
     "policy_step": S, "batch_counter": B, "signature": HEX}

where the signature is Ed25519 over canonical JSON of the other fields. (S, B) is the batch every row holds:
it lets a validator route the file before reading it (p2p/swarm/routing.py), and a file whose rows are
another batch fails `check_signer`. Format v1 (no batch fields) is still read: files written before it.
A reader trusts nothing
before the signature verifies: it checks the file size against its limit, reads the bounded envelope,
hashes the bytes, verifies the signature, and only then lets the Parquet parser near the data; then it
checks the schema exactly and what decoding will cost (from the footer and every page header, before
reading any column: proofs/rollout_layout.py), decodes within that bound, and checks every value's bounds.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..p2p.errors import SignatureError
from ..p2p.identity import Identity
from ..p2p.signing import canonical_json, verify_signature
from ..p2p.wire import WireFormatError, is_hex64, loads_strict
from .rollout_decode import decode_file
from .rollout_schema import SCHEMA, RolloutFileError, RolloutLimits, RolloutRow, check_rows

SIG_FORMAT = "prime-node/rollout-sig/v2"
SIG_FORMAT_V1 = "prime-node/rollout-sig/v1"
# A pipelined group's file: v2 plus the group whose batch it is, so that every file of one group's batch is
# routed to the same validator (p2p/swarm/routing.py, by group id), and its kind: a member's stage file
# (proofs/pipeline/stage_file.py), a receiver's fraud evidence against its predecessor, or a member's partial
# record of a batch that broke (proofs/pipeline/reports.py).
SIG_FORMAT_STAGE = "prime-node/rollout-sig/v3"
GROUP_FILE_KINDS = ("stage", "fraud", "partial")
SIG_SUFFIX = ".sig"
MAX_SIG_BYTES = 4096
_BATCH_FIELDS = ("policy_step", "batch_counter")
# The fields of each format, signature last (p2p/swarm/handoff.py RolloutEnvelope is the same document).
_SIG_FIELDS = {
    SIG_FORMAT_V1: ("format", "node_id", "sha256", "size", "signature"),
    SIG_FORMAT: ("format", "node_id", "sha256", "size", *_BATCH_FIELDS, "signature"),
    SIG_FORMAT_STAGE: ("format", "node_id", "sha256", "size", *_BATCH_FIELDS, "group", "kind", "signature"),
}
_MAX_BATCH_VALUE = (1 << 63) - 1  # int64 columns: what a row can hold


@dataclass(frozen=True)
class RolloutFile:
    """A verified, parsed rollout file."""

    path: Path
    sha256: str
    signer: str  # hex public key that signed it (equals every row's node_id)
    rows: tuple[RolloutRow, ...]


def signature_path(path: Path) -> Path:
    return Path(f"{path}{SIG_SUFFIX}")


def encode_rows(rows: list[RolloutRow]) -> bytes:
    """The Parquet bytes of `rows` under the pinned schema."""
    table = pa.Table.from_pylist([r.to_record() for r in rows], schema=SCHEMA)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def sign_bytes(
    data: bytes,
    identity: Identity,
    *,
    batch: tuple[int, int] | None,
    group: str | None = None,
    kind: str = "stage",
) -> dict[str, Any]:
    """The signature envelope of `data` (a JSON object): v2 signing `batch` (policy step, batch counter), or v1
    when `batch` is None (what nodes wrote before v2; validators refuse it at the hand-off); v3 (a pipelined
    group's file of `kind`) when `group` names the group whose batch it is."""
    body: dict[str, Any] = {
        "format": SIG_FORMAT_STAGE
        if group is not None
        else SIG_FORMAT
        if batch is not None
        else SIG_FORMAT_V1,
        "node_id": identity.node_id,
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }
    if batch is not None:
        body["policy_step"], body["batch_counter"] = batch
    elif group is not None:
        raise RolloutFileError("a stage file's envelope signs its batch too", check="signature")
    if group is not None:
        body["group"], body["kind"] = group, kind
    return {**body, "signature": identity.sign(canonical_json(body)).hex()}


def batch_of(rows: list[RolloutRow]) -> tuple[int, int]:
    """(policy step, batch counter) of rows that check_rows passed (the same in every row)."""
    return rows[0].policy_step, rows[0].batch_counter


def envelope_batch(envelope: dict[str, Any]) -> tuple[int, int] | None:
    """The batch a parsed envelope signs; None for a v1 envelope."""
    if envelope["format"] == SIG_FORMAT_V1:
        return None
    return envelope["policy_step"], envelope["batch_counter"]


def envelope_group(envelope: dict[str, Any]) -> str | None:
    """The group a parsed v3 (stage file) envelope signs; None for the other formats."""
    return envelope["group"] if envelope["format"] == SIG_FORMAT_STAGE else None


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_rollout_file(
    path: Path, rows: list[RolloutRow], identity: Identity, limits: RolloutLimits | None = None
) -> Path:
    """Write `rows` to `path` and the signature envelope beside it; returns the envelope's path.

    The rows are checked with the readers' own bounds first, so a node never publishes a file that
    honest validators would reject as malformed.
    """
    check_rows(rows, limits or RolloutLimits())
    if any(r.node_id != identity.node_id for r in rows):
        raise RolloutFileError("rows name another node id than the signing key", check="bounds")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = encode_rows(rows)
    write_atomic(path, data)
    sig_path = signature_path(path)
    envelope = sign_bytes(data, identity, batch=batch_of(rows))
    write_atomic(sig_path, json.dumps(envelope, sort_keys=True).encode() + b"\n")
    return sig_path


def sign_again(path: Path, sig_path: Path, identity: Identity) -> dict[str, Any]:
    """Replace a v1 envelope of one of this node's own files by a v2 one that signs the batch its rows hold.

    For files a node wrote and signed before v2 and has not handed off yet (validators refuse v1). The file is
    the node's own, so it is read without the hostile-input bounds; only the two batch columns are decoded.
    """
    data = Path(path).read_bytes()
    try:
        table = pq.read_table(io.BytesIO(data), columns=list(_BATCH_FIELDS))
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise RolloutFileError(f"cannot read the batch of {path}: {exc}", check="schema") from None
    batches = set(zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True))
    if len(batches) != 1:
        raise RolloutFileError(f"{path} holds {len(batches)} batches, not one", check="bounds")
    envelope = sign_bytes(data, identity, batch=batches.pop())
    write_atomic(Path(sig_path), json.dumps(envelope, sort_keys=True).encode() + b"\n")
    return envelope


def parse_envelope(raw: bytes) -> dict[str, Any]:
    """A signature envelope, strictly: exactly the fields of its format with the expected types."""
    try:
        envelope = loads_strict(raw, "signature file")  # NaN, infinities and duplicate keys refused
    except WireFormatError as exc:
        raise RolloutFileError(str(exc), check="signature") from None
    if not isinstance(envelope, dict):
        raise RolloutFileError("signature file must hold a JSON object", check="signature")
    fields = _SIG_FIELDS.get(envelope.get("format"))  # type: ignore[arg-type]
    if fields is None:
        raise RolloutFileError(
            f"signature format {str(envelope.get('format'))[:80]!r}, expected {SIG_FORMAT} "
            f"(or {SIG_FORMAT_V1}, or {SIG_FORMAT_STAGE} for a pipeline stage's file)",
            check="signature",
        )
    if sorted(envelope) != sorted(fields):
        raise RolloutFileError(
            f"a {envelope['format']} signature file must hold exactly the fields {fields}", check="signature"
        )
    numbers = ("size", *(_BATCH_FIELDS if envelope["format"] != SIG_FORMAT_V1 else ()))
    texts = (
        "node_id",
        "sha256",
        "signature",
        *(("group", "kind") if envelope["format"] == SIG_FORMAT_STAGE else ()),
    )
    if not all(isinstance(envelope[k], str) for k in texts) or not all(
        isinstance(envelope[k], int) and not isinstance(envelope[k], bool) for k in numbers
    ):
        raise RolloutFileError("signature file has fields of the wrong type", check="signature")
    if envelope["format"] == SIG_FORMAT_STAGE and not is_hex64(envelope["group"]):
        raise RolloutFileError("signature file's group is not 64 lowercase hex digits", check="signature")
    if envelope["format"] == SIG_FORMAT_STAGE and envelope["kind"] not in GROUP_FILE_KINDS:
        raise RolloutFileError(f"signature file's kind is not one of {GROUP_FILE_KINDS}", check="signature")
    if any(not 0 <= envelope[k] <= _MAX_BATCH_VALUE for k in numbers):
        raise RolloutFileError(f"signature file's {'/'.join(numbers)} out of range", check="signature")
    return envelope


def verify_envelope(data: bytes, envelope: dict[str, Any], expected_signer: str | None = None) -> str:
    """Check that `envelope` signs exactly `data`; returns the signer's node id."""
    signer = envelope["node_id"]
    if expected_signer is not None and signer != expected_signer:
        raise RolloutFileError(
            f"file is signed by {signer[:16]}…, expected {expected_signer[:16]}…", check="signature"
        )
    if envelope["size"] != len(data) or envelope["sha256"] != hashlib.sha256(data).hexdigest():
        raise RolloutFileError(
            "file content does not match its signed SHA-256 (altered after signing?)", check="signature"
        )
    body = {k: envelope[k] for k in _SIG_FIELDS[envelope["format"]] if k != "signature"}
    try:
        signature = bytes.fromhex(envelope["signature"])
        verify_signature(signer, canonical_json(body), signature)
    except (ValueError, SignatureError) as exc:
        raise RolloutFileError(f"bad signature: {exc}", check="signature") from None
    return signer


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise RolloutFileError(
                    f"{what} {path} is {size} bytes, over the {limit}-byte limit", check="signature"
                )
            # The file's size, not the limit: read(n) allocates n bytes up front (357 MiB for a fraud report's
            # limit), whatever the file holds. One byte more shows a file that grew since fstat.
            data = f.read(size + 1)
    except FileNotFoundError:
        raise RolloutFileError(f"{what} {path} does not exist", check="signature") from None
    if len(data) != size:
        raise RolloutFileError(f"{what} {path} changed while being read", check="signature")
    return data


def decode_rows(data: bytes, limits: RolloutLimits) -> list[RolloutRow]:
    """Parse signed Parquet bytes within `limits`: the footer and every page header verified and held to the
    limits before any column is decoded, then the columns one by one (proofs/rollout_decode.py).

    Value bounds are the caller's next step (check_rows), kept apart so a verifier reports them as
    their own check.
    """
    return decode_file(data, limits)


def read_rollout_file(
    path: Path, limits: RolloutLimits | None = None, expected_signer: str | None = None
) -> RolloutFile:
    """Read and fully check a rollout file and its signature; raises RolloutFileError naming the check."""
    limits = limits or RolloutLimits()
    path = Path(path)
    envelope = parse_envelope(read_bounded(signature_path(path), MAX_SIG_BYTES, "signature file"))
    if envelope["format"] == SIG_FORMAT_STAGE:
        raise RolloutFileError(
            f"{SIG_FORMAT_STAGE} signs a pipeline stage's file, which a group verdict judges "
            "(proofs/pipeline/stage_file.py), not a rollout file",
            check="schema",
        )
    data = read_bounded(path, limits.max_file_bytes, "rollout file")
    signer = verify_envelope(data, envelope, expected_signer)
    rows = decode_rows(data, limits)
    check_rows(rows, limits)
    check_signer(rows, signer, envelope_batch(envelope))
    return RolloutFile(path=path, sha256=envelope["sha256"], signer=signer, rows=tuple(rows))


def check_signer(rows: list[RolloutRow], signer: str, batch: tuple[int, int] | None = None) -> None:
    """Every row must name the node that signed the file (a node cannot pass off another's work) and, when the
    envelope signs a batch (v2), be that batch: the batch decided where the file was sent, so rows of another
    batch would be work routed to a validator that does not own it."""
    if any(r.node_id != signer for r in rows):
        raise RolloutFileError(
            f"rows claim node {rows[0].node_id[:16]}… but the file is signed by {signer[:16]}…",
            check="signature",
        )
    held = {(r.policy_step, r.batch_counter) for r in rows}
    # Rows of several batches hold no one batch: a malformed file, which the bounds check names (a fault).
    if batch is not None and len(held) == 1 and held != {batch}:
        step, counter = held.pop()
        raise RolloutFileError(
            f"the rows are batch {counter} of policy step {step}, but the envelope signs batch {batch[1]} of "
            f"policy step {batch[0]}",
            check="signature",
        )
