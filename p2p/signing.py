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

from .errors import SignatureError, UnsignableDocument
from .wire import printable

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def canonical_json(document: Any) -> bytes:
    """Encode `document` as canonical JSON bytes (sorted keys, compact, UTF-8, finite numbers only).

    UnsignableDocument (a SignatureError) when it has no such form: NaN or infinity, nesting deeper than the
    encoder goes, or a string that UTF-8 cannot encode (a lone surrogate: `"\\ud800"` is valid JSON, so a
    peer's document can carry one). Every signer and verifier goes through here, so such a document is a
    refused signature wherever it arrives, never another exception escaping a reader.
    """
    try:
        text = json.dumps(
            document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as exc:  # NaN or Infinity: not representable in canonical JSON
        raise UnsignableDocument(f"document cannot be signed: {exc}") from None
    except RecursionError:
        raise UnsignableDocument("document cannot be signed: it is nested too deeply") from None
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsignableDocument(_unencodable(document)) from None


def _unencodable(document: Any) -> str:
    """Where the first string without a UTF-8 form is (keys included), for the error message."""
    stack: list[tuple[str, Any]] = [("", document)]
    while stack:
        path, value = stack.pop()
        texts = [value] if isinstance(value, str) else list(value) if isinstance(value, dict) else []
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                char = ord(text[exc.start])
                kind = "the text" if text is value else "a key"
                where = f"{kind} at {path or 'the top'}"
                return (
                    f"{where} holds U+{char:04X} (a lone surrogate): the document has no canonical UTF-8 "
                    "form, so it cannot be signed"
                )
        children = list(
            value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
        )
        for key, item in reversed(children):  # a key is peer text too: shown only in printable form
            name = printable(str(key))[:40]
            stack.append((f"{path}.{name}" if path else name, item))
    return "the document has no canonical UTF-8 form, so it cannot be signed"


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
