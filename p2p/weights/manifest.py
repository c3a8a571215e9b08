"""The signed manifest of one checkpoint version: what it holds, how it is cut into shards, who signed it.

A checkpoint is the concatenation of its files in manifest order, cut into fixed-size shards. The manifest
lists every file (relative path, size, SHA-256) and every shard (size, SHA-256), and `checkpoint_sha256`,
the SHA-256 over the concatenated raw 32-byte shard digests: it commits to every byte of the checkpoint
while letting a fetcher verify shards on all cores as they arrive, with no second pass over the data.

On the wire a manifest is `{"body": {...}, "signature": "<hex>"}`, the signature an Ed25519 signature over
the canonical JSON of `body` (p2p/signing.py). `parse_signed` treats the bytes as hostile: it bounds the
size, checks the signature against the pinned key while looking at nothing but the two top-level keys,
and only then validates the body's schema and consistency. docs/protocol.md (## Weights) pins the format.
"""

from __future__ import annotations

import bisect
import hashlib
import re
from functools import cached_property
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import SignatureError, UnsignableDocument
from ..names import RUN_ID_PATTERN
from ..signing import canonical_json, parse_public_key, verify_document
from ..wire import NodeId, Sha256Hex, WireFormatError, WireModel, check_printable, describe, loads_strict
from .errors import ManifestError

FORMAT = "prime-node-weights"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 8 << 20  # 8 MiB holds ~40k shard entries: a 2.5 TiB checkpoint at 64 MiB shards
MAX_FILES = 10_000
MAX_SHARDS = 100_000
MIN_SHARD_SIZE = 1 << 10
MAX_SHARD_SIZE = 1 << 30
MAX_TOTAL_SIZE = 4 << 40  # 4 TiB: larger than any checkpoint we expect, small enough to catch nonsense
MAX_PATH_CHARS = 1024
MAX_COMPONENT_CHARS = 255
MAX_STEP = 2**53  # exact in every JSON implementation
# Matched with fullmatch, never match: Python's $ also matches before a final newline ("config.json\n").
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=@,-]*")


def check_relative_path(path: str) -> str:
    """Accept only plain relative POSIX paths: no absolute paths, `..`, `.`, empty parts, backslashes or controls."""
    if not isinstance(path, str) or not path:
        raise ValueError("file path must be a non-empty string")
    if len(path) > MAX_PATH_CHARS:
        raise ValueError(f"file path longer than {MAX_PATH_CHARS} characters")
    check_printable(path, f"file path {path[:80]!r}")
    if path.startswith("/") or "\\" in path or ":" in path:
        raise ValueError(f"file path {path[:80]!r} is absolute or not a POSIX path")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(f"file path {path[:80]!r} has an empty, '.' or '..' component")
        if len(part) > MAX_COMPONENT_CHARS or not _COMPONENT.fullmatch(part):
            raise ValueError(
                f"file path {path[:80]!r} has a component with characters outside [A-Za-z0-9._+=@,-]"
            )
    return path


class FileEntry(WireModel):
    """One file of the checkpoint, in concatenation order."""

    path: str = Field(description="Relative POSIX path inside the checkpoint directory.")
    size: int = Field(ge=0, le=MAX_TOTAL_SIZE, description="File size in bytes.")
    sha256: Sha256Hex = Field(description="SHA-256 of the file's bytes (sha256sum-compatible).")

    @field_validator("path")
    @classmethod
    def _plain_path(cls, value: str) -> str:
        return check_relative_path(value)


class ShardEntry(WireModel):
    """One fixed-size slice of the concatenated files (the last one may be shorter)."""

    size: int = Field(ge=1, le=MAX_SHARD_SIZE, description="Shard size in bytes.")
    sha256: Sha256Hex = Field(description="SHA-256 of the shard's bytes.")


class ManifestBody(WireModel):
    """The signed part of a manifest."""

    format: Literal["prime-node-weights"] = Field(description="Document type tag.")
    format_version: Literal[1] = Field(description="Manifest format version.")
    run_id: str = Field(pattern=RUN_ID_PATTERN, description="The training run this checkpoint belongs to.")
    step: int = Field(ge=0, le=MAX_STEP, description="Optimizer step that produced the checkpoint.")
    created_at: int = Field(ge=0, le=MAX_STEP, description="Unix time (seconds) the manifest was made.")
    signer: NodeId = Field(description="Hex Ed25519 public key of the signer.")
    shard_size: int = Field(
        ge=MIN_SHARD_SIZE, le=MAX_SHARD_SIZE, description="Size of every shard but the last."
    )
    total_size: int = Field(ge=1, le=MAX_TOTAL_SIZE, description="Sum of the file sizes.")
    checkpoint_sha256: Sha256Hex = Field(description="SHA-256 of the concatenated raw shard digests.")
    files: list[FileEntry] = Field(min_length=1, max_length=MAX_FILES, description="Files in order.")
    shards: list[ShardEntry] = Field(min_length=1, max_length=MAX_SHARDS, description="Shards in order.")

    @model_validator(mode="after")
    def _consistent(self) -> ManifestBody:
        seen: set[str] = set()
        for entry in self.files:
            key = entry.path.casefold()  # case-insensitive filesystems would merge "A" and "a"
            if key in seen:
                raise ValueError(f"duplicate file path {entry.path!r}")
            seen.add(key)
        for entry in self.files:  # "a" as a file and "a/b" would need "a" to be a directory too
            parts = entry.path.casefold().split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in seen:
                    raise ValueError(f"file path {entry.path!r} lies under another file")
        if sum(f.size for f in self.files) != self.total_size:
            raise ValueError("total_size is not the sum of the file sizes")
        expected = -(-self.total_size // self.shard_size)
        if len(self.shards) != expected:
            raise ValueError(
                f"{len(self.shards)} shards listed, {expected} expected for the total and shard size"
            )
        for index, shard in enumerate(self.shards):
            want = min(self.shard_size, self.total_size - index * self.shard_size)
            if shard.size != want:
                raise ValueError(f"shard {index} has size {shard.size}, expected {want}")
        if checkpoint_digest([s.sha256 for s in self.shards]) != self.checkpoint_sha256:
            raise ValueError("checkpoint_sha256 does not match the shard digests")
        return self


def checkpoint_digest(shard_hexdigests: list[str]) -> str:
    """The whole checkpoint's digest: SHA-256 over the concatenated raw shard digests."""
    h = hashlib.sha256()
    for digest in shard_hexdigests:
        h.update(bytes.fromhex(digest))
    return h.hexdigest()


class Segment(NamedTuple):
    """Where a piece of a shard lives: `length` bytes of file `file_index` from `file_offset`."""

    file_index: int
    file_offset: int
    shard_offset: int
    length: int


class SignedManifest(BaseModel):
    """A manifest whose signature has been checked against a pinned key."""

    model_config = ConfigDict(frozen=True)

    body: ManifestBody
    signature: str

    @cached_property
    def digest(self) -> str:
        """The manifest's id: SHA-256 of the canonical JSON of its body (what the DHT announces)."""
        return hashlib.sha256(canonical_json(self.body.model_dump(mode="json"))).hexdigest()

    @property
    def step(self) -> int:
        return self.body.step

    def to_bytes(self) -> bytes:
        return canonical_json({"body": self.body.model_dump(mode="json"), "signature": self.signature})

    def shard_offset(self, index: int) -> int:
        return index * self.body.shard_size

    @cached_property
    def _file_starts(self) -> list[int]:
        starts, pos = [], 0
        for entry in self.body.files:
            starts.append(pos)
            pos += entry.size
        return starts

    @cached_property
    def _segments_memo(self) -> dict[int, tuple[Segment, ...]]:
        return {}

    def segments(self, index: int) -> tuple[Segment, ...]:
        """The file pieces that make up shard `index` (a shard may span several files). Asked for every chunk
        written and every range served, so each shard's answer is kept (a few segments per shard)."""
        found = self._segments_memo.get(index)
        if found is None:
            found = self._segments_memo[index] = tuple(self._find_segments(index))
        return found

    def _find_segments(self, index: int) -> list[Segment]:
        start = self.shard_offset(index)
        end = start + self.body.shards[index].size
        out: list[Segment] = []
        first = max(
            0, bisect.bisect_right(self._file_starts, start) - 1
        )  # the file holding the shard's start
        files = self.body.files
        for file_index in range(first, len(files)):
            fstart, entry = self._file_starts[file_index], files[file_index]
            if fstart >= end:
                break
            lo, hi = max(start, fstart), min(end, fstart + entry.size)
            if lo < hi:
                out.append(
                    Segment(
                        file_index=file_index,
                        file_offset=lo - fstart,
                        shard_offset=lo - start,
                        length=hi - lo,
                    )
                )
        return out


def parse_signed(raw: bytes, trusted_key: str, *, max_bytes: int = MAX_MANIFEST_BYTES) -> SignedManifest:
    """Parse and verify a manifest from untrusted bytes; raises ManifestError naming what was wrong."""
    parse_public_key(trusted_key)  # a malformed pinned key is the operator's error, reported as such
    if len(raw) > max_bytes:
        raise ManifestError(f"manifest is {len(raw)} bytes, over the {max_bytes}-byte limit")
    try:
        doc = loads_strict(raw, "manifest")  # duplicate keys, NaN and infinities refused, by name
    except WireFormatError as exc:
        raise ManifestError(f"manifest is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"body", "signature"}:
        raise ManifestError("manifest must be a JSON object with exactly the keys 'body' and 'signature'")
    body, signature = doc["body"], doc["signature"]
    if (
        not isinstance(body, dict)
        or not isinstance(signature, str)
        or not re.fullmatch(r"[0-9a-f]{128}", signature)
    ):
        raise ManifestError("manifest 'body' must be an object and 'signature' 128 lowercase hex digits")
    # The signature is checked before any field of the body is interpreted: an unsigned or foreign
    # document never reaches the schema, so parser bugs there are not reachable by an attacker.
    try:
        verify_document(trusted_key, body, bytes.fromhex(signature))
    except UnsignableDocument as exc:  # e.g. a lone surrogate escape: valid JSON, no UTF-8 form
        raise ManifestError(f"manifest body: {exc}") from None
    except SignatureError:
        claimed = body.get("signer")
        claimed_text = claimed[:16] if isinstance(claimed, str) else "nobody"
        raise ManifestError(
            f"manifest signature does not verify against the pinned trainer key {trusted_key[:16]}… "
            f"(it claims signer {claimed_text}…): it was signed by another key or edited after signing"
        ) from None
    try:
        parsed = ManifestBody.model_validate(body)
    except ValidationError as exc:
        raise ManifestError(f"signed manifest is invalid {describe(exc)}") from None
    if parsed.signer != trusted_key:
        raise ManifestError(
            f"manifest names signer {parsed.signer[:16]}… but was signed by {trusted_key[:16]}…"
        )
    return SignedManifest(body=parsed, signature=signature)


def sign_manifest(body: ManifestBody, identity: Any) -> SignedManifest:
    """Sign `body` with an Identity (p2p/identity.py) whose public key must be `body.signer`."""
    if identity.node_id != body.signer:
        raise ManifestError("the manifest's signer field must be the signing identity's public key")
    signature = identity.sign_document(body.model_dump(mode="json")).hex()
    return SignedManifest(body=body, signature=signature)
