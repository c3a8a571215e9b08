"""Signed shard availability: which verified shards of one version a weights server holds, signed by its node.

A node that re-serves weights starts serving each shard as soon as it verified, long before it holds the
whole checkpoint. Fetchers ask it which shards it holds (GET /v1/weights/{step}/availability) so they ask it
only for those and fetch the rarest shards first. The answer is a small signed document:

    {"body": {"format": "prime-node-availability", "version": 1, "node_id": <64 hex>, "step": N,
              "manifest_sha256": <64 hex>, "shard_count": K, "have": "<base64 bitmap>", "issued_at_ms": T},
     "signature": "<128 hex>"}

`have` is a bitmap of K bits, shard i in bit 7 - i % 8 of byte i // 8, padding bits zero, in canonical base64.

Why signed: a claim is attributable. A server that claims a shard and then answers 404 or a plain 503 has
lied under its own key; the fetcher demotes it (sources.py `record_lie`) and keeps the record for the report.
The record names the manifest digest and shard count, so a claim about another build of the step is refused.

The bytes are hostile: the size is bounded before decoding, JSON is decoded strictly, the signature is checked
against the node id the body names before any other field is read, then the schema, the manifest binding, the
bitmap's exact length and zero padding, and the time: a record older than `MAX_AGE_S` is stale (an old record
replayed cannot advertise shards a server dropped), one dated beyond the same skew in the future is refused.

A stale record is `StaleAvailability`, which is not a lie: it is what an honest node whose clock runs behind
signs, and what the network delivers late, so the fetcher ignores it and asks again (peering.py). Only what
a node cannot sign by accident is charged: a bad signature, a malformed body, another manifest, or a date
in the future beyond the skew, which no replay can produce and no honest clock behind ours can either.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Set as AbstractSet
from typing import Final, Literal

from pydantic import Field, ValidationError

from ..errors import SignatureError, UnsignableDocument
from ..identity import Identity
from ..signing import canonical_json, verify_document
from ..wire import NodeId, Sha256Hex, WireFormatError, WireModel, describe, is_hex64, loads_strict
from .errors import SourceError
from .manifest import MAX_SHARDS, MAX_STEP, SignedManifest

FORMAT: Final = "prime-node-availability"
FORMAT_VERSION: Final = 1
# 100,000 shards are 12,500 bitmap bytes, 16,668 in base64; the rest of the document is under 500 bytes.
MAX_AVAILABILITY_BYTES = 20 << 10
MAX_AGE_S = 300.0  # clock skew tolerated either way, as for access tokens
_MAX_TIME_MS = 10**15  # year 33658: bounds the integer before any arithmetic


class AvailabilityError(SourceError):
    """An availability record that is oversized, malformed, badly signed, stale, or about another version."""


class StaleAvailability(AvailabilityError):
    """A validly signed record older than MAX_AGE_S: a skewed clock or a late answer, not a lie. Never taken
    (a replay cannot revive old claims), never charged."""


class AvailabilityBody(WireModel):
    """What a node claims to hold of one version (see the module docstring)."""

    format: Literal["prime-node-availability"] = Field(description="Document type tag.")
    version: Literal[1] = Field(description="Format version.")
    node_id: NodeId = Field(description="The signing node's Ed25519 public key.")
    step: int = Field(ge=0, le=MAX_STEP, description="The version's step.")
    manifest_sha256: Sha256Hex = Field(description="Digest of the signed manifest the shards belong to.")
    shard_count: int = Field(ge=1, le=MAX_SHARDS, description="Shards in that manifest: the bitmap's length.")
    have: str = Field(
        max_length=(MAX_SHARDS + 7) // 8 * 4 // 3 + 4, description="Base64 bitmap of held shards."
    )
    issued_at_ms: int = Field(ge=0, le=_MAX_TIME_MS, description="When it was signed (Unix ms).")


def encode_bitmap(held: set[int] | frozenset[int], count: int) -> str:
    bits = bytearray((count + 7) // 8)
    for index in held:
        if 0 <= index < count:
            bits[index // 8] |= 0x80 >> (index % 8)
    return base64.b64encode(bytes(bits)).decode("ascii")


def decode_bitmap(text: str, count: int) -> frozenset[int]:
    """The shard indices of a canonical `count`-bit bitmap; AvailabilityError for any other text."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise AvailabilityError("availability bitmap is not base64", corrupt=True) from None
    if len(raw) != (count + 7) // 8 or base64.b64encode(raw).decode("ascii") != text:
        raise AvailabilityError(
            f"availability bitmap has {len(raw)} bytes, not the {(count + 7) // 8} of {count} shards "
            "in canonical base64",
            corrupt=True,
        )
    if count % 8 and raw[-1] & (0xFF >> (count % 8)):
        raise AvailabilityError("availability bitmap sets bits past the last shard", corrupt=True)
    return frozenset(i for i in range(count) if raw[i // 8] & (0x80 >> (i % 8)))


def sign_availability(
    identity: Identity, manifest: SignedManifest, held: set[int] | frozenset[int], now: float | None = None
) -> bytes:
    count = len(manifest.body.shards)
    body = AvailabilityBody(
        format=FORMAT,
        version=FORMAT_VERSION,
        node_id=identity.node_id,
        step=manifest.step,
        manifest_sha256=manifest.digest,
        shard_count=count,
        have=encode_bitmap(held, count),
        issued_at_ms=int((time.time() if now is None else now) * 1000),
    ).model_dump()
    return canonical_json({"body": body, "signature": identity.sign_document(body).hex()})


def parse_availability(
    raw: bytes,
    manifest: SignedManifest,
    *,
    signers: AbstractSet[str] | None = None,
    now: float | None = None,
) -> tuple[AvailabilityBody, frozenset[int]]:
    """Verify a peer's record for `manifest` (signed by one of `signers` when given: the node ids a source may
    be); returns it and the shards it claims. AvailabilityError (naming what is wrong) for anything else."""
    parsed = verify_signed_record(raw, signers=signers)
    if parsed.step != manifest.step or parsed.manifest_sha256 != manifest.digest:
        raise AvailabilityError(
            f"availability record is about manifest {parsed.manifest_sha256[:16]}… of step {parsed.step}, "
            f"not {manifest.digest[:16]}… of step {manifest.step}",
            corrupt=True,
        )
    if parsed.shard_count != len(manifest.body.shards):
        raise AvailabilityError(
            f"availability record counts {parsed.shard_count} shards; the manifest has {len(manifest.body.shards)}",
            corrupt=True,
        )
    check_current(parsed, now)
    return parsed, decode_bitmap(parsed.have, parsed.shard_count)


def verify_signed_record(raw: bytes, *, signers: AbstractSet[str] | None = None) -> AvailabilityBody:
    """The body of a record whose size, JSON, signer (one of `signers` when given) and signature verify and whose
    fields match the schema; not yet checked against any manifest nor for its age (`parse_availability` does
    both; a dial-back proof of who serves at a URL needs only this and `check_current`)."""
    if len(raw) > MAX_AVAILABILITY_BYTES:
        raise AvailabilityError(
            f"availability record is {len(raw)} bytes, over the {MAX_AVAILABILITY_BYTES}-byte limit",
            corrupt=True,
        )
    try:
        doc = loads_strict(raw, "availability record")
    except WireFormatError as exc:
        raise AvailabilityError(f"availability record is not valid JSON: {exc}", corrupt=True) from None
    if not isinstance(doc, dict) or set(doc) != {"body", "signature"}:
        raise AvailabilityError(
            "availability record must have exactly the keys 'body' and 'signature'", corrupt=True
        )
    body, signature = doc["body"], doc["signature"]
    signer = body.get("node_id") if isinstance(body, dict) else None
    if (
        not isinstance(signer, str)
        or not is_hex64(signer)
        or not isinstance(signature, str)
        or not is_hex128(signature)
    ):
        raise AvailabilityError(
            "availability record needs a body with a 64-hex node_id and a 128-hex signature", corrupt=True
        )
    if signers is not None and signer not in signers:
        named = [f"{s[:16]}…" for s in sorted(signers)[:3]]
        if len(signers) > 3:
            named.append(f"{len(signers) - 3} more")
        expected = " or ".join(named) or "no node id"
        raise AvailabilityError(
            f"availability record is signed by {signer[:16]}…, not by {expected}", corrupt=True
        )
    try:  # the signature first: nothing of an unsigned or edited body is interpreted
        verify_document(signer, body, bytes.fromhex(signature))
    except UnsignableDocument as exc:  # e.g. a lone surrogate escape: valid JSON, no UTF-8 form, by name
        raise AvailabilityError(f"availability record body: {exc}", corrupt=True) from None
    except SignatureError:
        raise AvailabilityError(
            f"availability record signature does not verify for {signer[:16]}…", corrupt=True
        ) from None
    try:
        return AvailabilityBody.model_validate(body)
    except ValidationError as exc:
        raise AvailabilityError(f"availability record is invalid {describe(exc)}", corrupt=True) from None


def check_current(parsed: AvailabilityBody, now: float | None = None) -> None:
    """StaleAvailability for a record older than MAX_AGE_S, AvailabilityError for one dated beyond the same skew
    in the future (see the module docstring)."""
    age = (time.time() if now is None else now) - parsed.issued_at_ms / 1000
    if age > MAX_AGE_S:
        raise StaleAvailability(
            f"availability record was signed {age:.0f} s ago; records live {MAX_AGE_S:.0f} s (check the clock)"
        )
    if -age > MAX_AGE_S:
        raise AvailabilityError(
            f"availability record is dated {-age:.0f} s in the future, beyond the {MAX_AGE_S:.0f} s of clock "
            "skew tolerated",
            corrupt=True,
        )


def is_hex128(text: str) -> bool:
    return len(text) == 128 and all(c in "0123456789abcdef" for c in text)
