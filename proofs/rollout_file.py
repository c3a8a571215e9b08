"""Writing, signing and reading rollout files (Parquet + a detached signature envelope).

`FILE.parquet` travels with `FILE.parquet.sig`, a small JSON envelope signed by the producing node:

    {"format": "prime-node/rollout-sig/v1", "node_id": HEX, "sha256": HEX, "size": N, "signature": HEX}

where the signature is Ed25519 over canonical JSON of the other four fields. A reader trusts nothing
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
from ..p2p.wire import WireFormatError, loads_strict
from .rollout_decode import decode_file
from .rollout_schema import SCHEMA, RolloutFileError, RolloutLimits, RolloutRow, check_rows

SIG_FORMAT = "prime-node/rollout-sig/v1"
SIG_SUFFIX = ".sig"
MAX_SIG_BYTES = 4096
_SIG_FIELDS = ("format", "node_id", "sha256", "size", "signature")


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


def sign_bytes(data: bytes, identity: Identity) -> dict[str, Any]:
    """The signature envelope of `data` (a JSON object)."""
    body = {
        "format": SIG_FORMAT,
        "node_id": identity.node_id,
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }
    return {**body, "signature": identity.sign(canonical_json(body)).hex()}


def _write_atomic(path: Path, data: bytes) -> None:
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
    _write_atomic(path, data)
    sig_path = signature_path(path)
    _write_atomic(sig_path, json.dumps(sign_bytes(data, identity), sort_keys=True).encode() + b"\n")
    return sig_path


def parse_envelope(raw: bytes) -> dict[str, Any]:
    """A signature envelope, strictly: exactly the expected fields with the expected types."""
    try:
        envelope = loads_strict(raw, "signature file")  # NaN, infinities and duplicate keys refused
    except WireFormatError as exc:
        raise RolloutFileError(str(exc), check="signature") from None
    if not isinstance(envelope, dict) or sorted(envelope) != sorted(_SIG_FIELDS):
        raise RolloutFileError(
            f"signature file must hold exactly the fields {_SIG_FIELDS}", check="signature"
        )
    if envelope["format"] != SIG_FORMAT:
        raise RolloutFileError(
            f"signature format {envelope['format']!r}, expected {SIG_FORMAT}", check="signature"
        )
    if (
        not all(isinstance(envelope[k], str) for k in ("node_id", "sha256", "signature"))
        or not isinstance(envelope["size"], int)
        or isinstance(envelope["size"], bool)
    ):
        raise RolloutFileError("signature file has fields of the wrong type", check="signature")
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
    body = {k: envelope[k] for k in _SIG_FIELDS if k != "signature"}
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
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise RolloutFileError(f"{what} {path} does not exist", check="signature") from None
    if len(data) > limit:  # grew while being read
        raise RolloutFileError(f"{what} {path} is over the {limit}-byte limit", check="signature")
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
    data = read_bounded(path, limits.max_file_bytes, "rollout file")
    signer = verify_envelope(data, envelope, expected_signer)
    rows = decode_rows(data, limits)
    check_rows(rows, limits)
    check_signer(rows, signer)
    return RolloutFile(path=path, sha256=envelope["sha256"], signer=signer, rows=tuple(rows))


def check_signer(rows: list[RolloutRow], signer: str) -> None:
    """Every row must name the node that signed the file (a node cannot pass off another's work)."""
    if any(r.node_id != signer for r in rows):
        raise RolloutFileError(
            f"rows claim node {rows[0].node_id[:16]}… but the file is signed by {signer[:16]}…",
            check="signature",
        )
