"""Signed documents the validator side issues: the verdict on one rollout file, and the ban record.

A wire format, so it lives in p2p/: validators write it and contributors read it (node/ never imports trainer/).

Both travel as a JSON envelope `{"document": {...}, "signature": "<128 hex>"}`. The signature is a detached
Ed25519 signature over the canonical JSON of `document` (p2p/signing.py), made by the key named inside the
document (`validator_id` for a verdict, `issuer_id` for a ban), and a reader accepts the document only when
that key is one it trusts (the validators announced by the operator; the pinned operator key for bans).

Reading is ordered for hostile input: size limit, then the envelope's two fields, then the signer against
the trusted set, then the signature over the raw document, and only then the strict schema. A `kind` field
separates the document types, so a signature over a verdict can never be presented as a ban or the reverse.
The ban record here is the plain signed document, portable and checkable offline (the ledger keeps it and
a validator can hand it to whoever asks why a node is refused). Inside the swarm a ban travels as the
operator-signed DHT record of p2p/swarm/records.py (`Ban`), whose TTL is its expiry: the validator service
republishes it while the ledger says the ban is in force, for ever when it is permanent.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import P2PError
from .identity import Identity
from .signing import SIGNATURE_BYTES, verify_document
from .wire import FreeText, NodeId, Sha256Hex, Timestamp, WireFormatError, WireModel, describe, loads_strict

CHECK_NAME = r"^[a-z][a-z0-9_]{0,47}$"
MAX_ENVELOPE_BYTES = 16 * 1024  # a verdict is a few hundred bytes; the reason text is capped below
MAX_REASON_CHARS = 2000
MAX_BAN_REASON_CHARS = 256


class DocumentError(P2PError):
    """A verdict or ban is malformed, oversized, signed by an untrusted key, or its signature fails."""


class _Document(WireModel):
    """Base of the signed documents: a WireModel (immutable, unknown fields refused, no type coercion, finite
    floats, printable strings)."""

    signer_field: ClassVar[str]

    def signer(self) -> str:
        return str(getattr(self, self.signer_field))

    def payload(self) -> dict[str, Any]:
        """The JSON-ready dict that is signed (canonical JSON of exactly this)."""
        return self.model_dump(mode="json")


class Verdict(_Document):
    """A validator's decision on one rollout file, as published to the sender and the ledger."""

    signer_field: ClassVar[str] = "validator_id"

    kind: Literal["prime-node/verdict/v1"] = (
        "prime-node/verdict/v1"  # domain separation between document types
    )
    file_hash: Sha256Hex = Field(description="SHA-256 of the rollout file, lowercase hex.")
    node_id: NodeId = Field(description="Node id (Ed25519 public key) that signed the rollout file.")
    step: int = Field(ge=0, description="Policy step (checkpoint) the rollouts claim to come from.")
    samples: int = Field(ge=0, description="Rows (completions) in the file; credited only when accepted.")
    tokens: int = Field(ge=0, description="Output tokens in the file; credited only when accepted.")
    accepted: bool = Field(description="True when every check passed.")
    failed_check: str | None = Field(None, pattern=CHECK_NAME, description="Name of the first failing check.")
    reason: Annotated[str, FreeText(MAX_REASON_CHARS)] = Field(
        "", description="Human-readable reason; empty when accepted."
    )
    validator_id: NodeId = Field(description="Public key of the validator that signs this verdict.")
    decided_at: Timestamp = Field(description="Unix time the verdict was reached.")

    @model_validator(mode="after")
    def _check_consistent(self) -> Verdict:
        if self.accepted and self.failed_check is not None:
            raise ValueError("an accepted verdict cannot name a failed check")
        if not self.accepted and self.failed_check is None:
            raise ValueError("a rejected verdict must name the failed check")
        return self


class BanRecord(_Document):
    """The operator's statement that a node is banned until a time (or for good)."""

    signer_field: ClassVar[str] = "issuer_id"

    kind: Literal["prime-node/ban/v1"] = "prime-node/ban/v1"
    node_id: NodeId = Field(description="The banned node.")
    # 256 characters: the DHT's ban record (p2p/swarm/records.py Ban) carries no more.
    reason: Annotated[str, FreeText(MAX_BAN_REASON_CHARS)] = Field(
        min_length=1, description="Why, e.g. the failed check."
    )
    issued_at: Timestamp = Field(description="Unix time the ban was decided.")
    until: Timestamp | None = Field(None, description="Unix end time; null is permanent.")
    issuer_id: NodeId = Field(description="Public key of the operator that signs the ban.")

    @model_validator(mode="after")
    def _check_times(self) -> BanRecord:
        if self.until is not None and self.until <= self.issued_at:
            raise ValueError("a ban must end after it was issued (use until=null for a permanent ban)")
        return self

    @property
    def permanent(self) -> bool:
        return self.until is None

    def active(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.until is None or now < self.until


Doc = TypeVar("Doc", bound=_Document)


class Signed(BaseModel, Generic[Doc]):
    """A document with the detached signature of the key its signer field names."""

    model_config = ConfigDict(frozen=True)

    document: Doc
    signature: bytes

    def to_json(self) -> bytes:
        return json.dumps(self.envelope(), sort_keys=True, separators=(",", ":")).encode()

    def envelope(self) -> dict[str, Any]:
        return {"document": self.document.payload(), "signature": self.signature.hex()}


def sign(document: Doc, identity: Identity) -> Signed[Doc]:
    """Sign `document` with `identity`, which must be the key the document names as its signer."""
    if identity.node_id != document.signer():
        raise DocumentError(
            f"{document.signer_field} is {document.signer()[:16]}… "
            f"but the signing key is {identity.node_id[:16]}…; "
            "sign with the key the document names"
        )
    signed_type: Any = Signed  # parametrised at run time by the document's own class
    return signed_type[type(document)](
        document=document, signature=identity.sign_document(document.payload())
    )


def open_signed(
    raw: bytes | str | dict[str, Any], model: type[Doc], trusted: frozenset[str] | set[str]
) -> Signed[Doc]:
    """Check and parse an envelope from a peer: size, signer trusted, signature, then the strict schema."""
    envelope = _load_envelope(raw)
    document, sig_hex = envelope.get("document"), envelope.get("signature")
    if (
        set(envelope) != {"document", "signature"}
        or not isinstance(document, dict)
        or not isinstance(sig_hex, str)
    ):
        raise DocumentError(
            "a signed envelope has exactly two fields: document (object) and signature (hex string)"
        )
    signer = document.get(model.signer_field)
    if not isinstance(signer, str) or signer not in trusted:
        raise DocumentError(
            f"{model.__name__} signed by {model.signer_field} {str(signer)[:16]!r}…, "
            "which is not a trusted key; "
            "check the pinned operator key and the announced validators"
        )
    try:
        signature = bytes.fromhex(sig_hex)
    except ValueError:
        raise DocumentError("signature is not hex") from None
    if len(signature) != SIGNATURE_BYTES:
        raise DocumentError(f"signature must be {SIGNATURE_BYTES} bytes, got {len(signature)}")
    try:
        verify_document(signer, document, signature)
    except P2PError as exc:
        raise DocumentError(f"{model.__name__} signature does not verify: {exc}") from exc
    try:
        parsed = model.model_validate(document)
    except ValidationError as exc:
        raise DocumentError(f"{model.__name__} does not match its schema {describe(exc)}") from None
    signed_type: Any = Signed  # parametrised at run time by the model the caller asked for
    return signed_type[model](document=parsed, signature=signature)


def verify_signed(signed: Signed[Doc], trusted: frozenset[str] | set[str]) -> Doc:
    """Re-check an in-memory signed document (e.g. one read back from the ledger) and return it."""
    return open_signed(signed.envelope(), type(signed.document), trusted).document


def _load_envelope(raw: bytes | str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(raw, dict):
        # Already decoded by a transport; measure it the way it would travel so the limit still holds.
        try:
            size = len(json.dumps(raw, separators=(",", ":"), default=str).encode())
        except (ValueError, RecursionError) as exc:  # a lone surrogate (UnicodeError), nesting too deep
            raise DocumentError(f"signed document cannot be measured as JSON: {str(exc)[:120]}") from None
        loaded: Any = raw
    else:
        size = len(raw.encode() if isinstance(raw, str) else raw)
        loaded = None
    if size > MAX_ENVELOPE_BYTES:
        raise DocumentError(f"signed document is {size} bytes, over the {MAX_ENVELOPE_BYTES}-byte limit")
    if loaded is None:
        assert not isinstance(raw, dict)  # measured and loaded above
        try:
            loaded = loads_strict(raw, "signed document")  # NaN and infinities refused here, by name
        except WireFormatError as exc:
            raise DocumentError(str(exc)) from None
    if not isinstance(loaded, dict):
        raise DocumentError("signed document must be a JSON object")
    return loaded
