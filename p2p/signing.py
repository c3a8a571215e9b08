"""Detached Ed25519 signatures and the canonical JSON encoding of signed documents.

Every signed document in prime-node (manifests, DHT records, verdicts) is signed over its canonical
JSON: UTF-8, keys sorted, no insignificant whitespace, no NaN/Infinity. Two parties that hold the same
document therefore sign and verify the same bytes, whatever JSON library produced it.
"""

from __future__ import annotations

import json
from typing import Any

import nacl.exceptions
import nacl.signing

from .errors import SignatureError

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def canonical_json(document: Any) -> bytes:
    """Encode `document` as canonical JSON bytes (sorted keys, compact, UTF-8, finite numbers only)."""
    try:
        text = json.dumps(
            document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as exc:  # NaN or Infinity: not representable in canonical JSON
        raise SignatureError(f"document cannot be signed: {exc}") from exc
    return text.encode("utf-8")


def parse_public_key(public_key_hex: str) -> nacl.signing.VerifyKey:
    """Parse a 64-hex-digit Ed25519 public key (a node id), with a clear error on bad input."""
    if not isinstance(public_key_hex, str):
        raise SignatureError(f"public key must be a hex string, got {type(public_key_hex).__name__}")
    try:
        raw = bytes.fromhex(public_key_hex)
    except ValueError as exc:
        raise SignatureError(f"public key is not hex: {public_key_hex[:80]!r}") from exc
    if len(raw) != PUBLIC_KEY_BYTES:
        raise SignatureError(
            f"public key must be {PUBLIC_KEY_BYTES} bytes (64 hex digits), got {len(raw)} bytes"
        )
    return nacl.signing.VerifyKey(raw)


def verify_signature(public_key_hex: str, message: bytes, signature: bytes) -> None:
    """Check a detached signature; raises SignatureError when it does not verify."""
    verify_key = parse_public_key(public_key_hex)
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_BYTES:
        raise SignatureError(f"signature must be {SIGNATURE_BYTES} bytes")
    try:
        verify_key.verify(bytes(message), bytes(signature))
    except nacl.exceptions.BadSignatureError as exc:
        raise SignatureError(f"bad signature for key {public_key_hex[:16]}…") from exc


def is_valid_signature(public_key_hex: str, message: bytes, signature: bytes) -> bool:
    """Boolean form of verify_signature, for filters that skip bad entries."""
    try:
        verify_signature(public_key_hex, message, signature)
    except SignatureError:
        return False
    return True


def verify_document(public_key_hex: str, document: Any, signature: bytes) -> None:
    """Check a detached signature over the canonical JSON of `document`."""
    verify_signature(public_key_hex, canonical_json(document), signature)
