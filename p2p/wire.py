"""The one base of every wire type, and strict JSON decoding of what peers send.

Everything a peer can send (DHT records, hand-off frames and receipts, verdicts, bans, manifests, API
payloads) is parsed into a `WireModel`. Its configuration is the rule for all of them at once, so a type or
field added later inherits it without anyone remembering to: strict types (no "3" for 3), unknown fields
refused, immutable, and **no NaN or infinity in any float field**, nested models, lists and unions included.
A NaN compares false with everything, so one that reaches `expiration > limit` or `until <= issued_at`
passes every bound it meets; infinities pass one side of each. They are refused at the parse instead.

Every string of every wire type is also refused if it holds a character that is not printable
(`str.isprintable`: control characters such as \\n, \\r, \\t, NUL and DEL, C1 controls, Unicode line and
paragraph separators, bidi overrides and other format characters, surrogates). Names travel into paths,
logs, terminals and dashboards; none of them has a use for these.

`parse_uint` is the one reader of an unsigned integer written as text by a peer or a user (an HTTP header,
a URL path, a query parameter, a command-line flag, a token field, a directory name): ASCII digits only,
matched whole and bounded before `int()` sees them. `str.isdigit()` and a regex's `\\d` accept '²', '١'
and every other Unicode digit (which `int()` then refuses, or reads as another number), and `int()` itself
accepts signs, underscores and surrounding whitespace.

`loads_strict` is the JSON decoder for peer bytes that are not parsed by a WireModel directly (frames, signed
envelopes, manifests): it refuses NaN, Infinity, -Infinity and numbers that overflow to infinity (1e999)
at the decoder, naming where they were, and refuses duplicate keys (two parsers that keep different copies
of a key would read different documents under one signature).

Shared field types: `Hex64` (and its names `NodeId`, an Ed25519 public key, and `Sha256Hex`, a digest) is the
one definition of a 64-lowercase-hex identifier; `is_hex64` checks one outside a model.
`Annotated[str, FreeText(n)]` marks a field of human-readable text that our own code fills from exception
messages, drivers or a ledger: `Model.outgoing(...)` makes such fields printable and cuts them to `n`
characters before validating, so what we sign or serve is never refused by an honest reader, while a peer's
document is still refused for the same characters (readers do not repair what a peer signed). `parse_uint`
reads a number a peer or an operator wrote in ASCII digits.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Self

from annotated_types import GroupedMetadata
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from .errors import P2PError

# Year 2242: a wire timestamp past this is a forgery or a broken clock, and far below where float seconds
# lose sub-millisecond precision. Every timestamp on the wire is a Timestamp.
MAX_UNIX_TIME = float(2**33)
Timestamp = Annotated[float, Field(ge=0, le=MAX_UNIX_TIME)]

# A pydantic pattern is matched by Rust's regex crate, whose $ is the very end of the text (no final "\n");
# Python code uses HEX64_RE.fullmatch (is_hex64), never re.match with $.
HEX64_PATTERN = r"^[0-9a-f]{64}$"
HEX64_RE = re.compile(r"[0-9a-f]{64}")
HEX_DIGITS = frozenset("0123456789abcdef")  # lowercase: the one spelling of ids and digests
Hex64 = Annotated[str, StringConstraints(pattern=HEX64_PATTERN)]
NodeId = Hex64  # a node's Ed25519 public key in lowercase hex: its identity everywhere
Sha256Hex = Hex64  # a SHA-256 digest in lowercase hex


def is_hex64(text: object) -> bool:
    """Whether `text` is 64 lowercase hex digits (a node id, a public key, a SHA-256 digest)."""
    return isinstance(text, str) and HEX64_RE.fullmatch(text) is not None


class WireFormatError(P2PError, ValueError):
    """Peer bytes that are not in the strict wire format: JSON with a NaN or infinite number, a duplicate key,
    bad UTF-8 or too deep; a number that is not plain ASCII digits or is out of bounds."""


_DIGITS = re.compile(r"[0-9]+")  # ASCII only: [0-9], never \d (which matches every Unicode digit)
_MAX_DIGITS = 19  # 2**63 has 19 digits: more is over any bound we use, and int() never reads thousands


def parse_uint(text: str, what: str, *, maximum: int, minimum: int = 0, width: int | None = None) -> int:
    """`text` as an unsigned integer from `minimum` to `maximum`, written in ASCII digits only and nothing
    else (no sign, space, underscore or other digit); with `width`, exactly that many digits (fixed-width
    names such as step-000000000003). WireFormatError (a ValueError) naming `what` otherwise."""
    if not _DIGITS.fullmatch(text) or (width is not None and len(text) != width):
        shape = f"{width} ASCII digits" if width is not None else "a number in ASCII digits"
        raise WireFormatError(f"{what} {text[:40]!r} is not {shape}")
    number = int(text) if len(text) <= _MAX_DIGITS else None
    if number is None or number > maximum:
        raise WireFormatError(f"{what} {text[:40]} is over the {maximum} allowed")
    if number < minimum:
        raise WireFormatError(f"{what} {number} is under the {minimum} allowed")
    return number


def unprintable(text: str) -> str | None:
    """A description of the first character of `text` that is not printable, or None when all are."""
    if text.isprintable():  # C speed: the common case costs one pass
        return None
    for position, char in enumerate(text):
        if not char.isprintable():
            return f"character U+{ord(char):04X} at position {position}"
    return None  # not reached: isprintable() was False


def check_printable(text: str, what: str = "text") -> str:
    """`text` unchanged, or ValueError naming its first control (or other unprintable) character."""
    found = unprintable(text)
    if found is not None:
        raise ValueError(f"{what} holds the unprintable {found}; control and format characters are refused")
    return text


def printable(text: str) -> str:
    """`text` with every unprintable character replaced by a space: for free text we put on the wire
    (reasons built from exception messages may hold newlines), so that honest peers never refuse it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else " " for c in text)


_OUTGOING = {"outgoing": True}  # validation context of WireModel.outgoing


@dataclass(frozen=True)
class FreeText(GroupedMetadata):
    """`Annotated[str, FreeText(n)]`: a text field of at most `n` printable characters; `Model.outgoing`
    makes ours fit. (Metadata rather than a function returning a type, so that type checkers read it.)"""

    max_chars: int

    def _fit(self, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and info.context is _OUTGOING:
            return printable(value[: self.max_chars])
        return value

    def __iter__(self) -> Iterator[object]:
        yield BeforeValidator(self._fit)
        yield StringConstraints(max_length=self.max_chars)


def _check_strings(value: Any, where: str) -> None:
    if isinstance(value, str):
        check_printable(value, where)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_strings(item, f"item {index}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, "a key")
            _check_strings(item, f"item {str(key)[:40]!r}")
    # Nested WireModels check their own fields; numbers and booleans have nothing to check.


class WireModel(BaseModel):
    """Base of every type parsed from peer bytes; see the module docstring for what it guarantees."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _printable_strings(cls, value: Any, info: ValidationInfo) -> Any:
        _check_strings(value, "text")
        return value

    @classmethod
    def outgoing(cls, **fields: Any) -> Self:
        """A document of our own to sign or serve: every `FreeText` field (nested ones included) is made
        printable and cut to its length first; everything else is validated as a peer's document is."""
        return cls.model_validate(fields, context=_OUTGOING)


def describe(exc: ValidationError) -> str:
    """The first error of a wire type's validation with the field's dotted path: `at run.temperature: ...`."""
    first = exc.errors()[0]
    # A location holds the peer's own dict keys: shown only in printable form, and short.
    where = ".".join(printable(str(part))[:40] for part in first["loc"]) or "(the whole document)"
    return f"at {where}: {first['msg']}"


class _NonFinite:
    """Placeholder the decoder puts where a NaN or infinite number was, so the path can be named after."""

    __slots__ = ("literal",)

    def __init__(self, literal: str) -> None:
        self.literal = literal


def _find_non_finite(value: Any, path: str) -> tuple[str, str] | None:
    """(dotted path, literal) of the first non-finite number in a decoded document."""
    if isinstance(value, _NonFinite):
        return path, value.literal
    children: Any = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    )
    for key, item in children:
        name = printable(str(key))[:40]  # a peer's key: printable in the message
        found = _find_non_finite(item, f"{path}.{name}" if path else name)
        if found is not None:
            return found
    return None


def loads_strict(raw: bytes | str, what: str = "document") -> Any:
    """Decode a peer's JSON; WireFormatError (naming the place) for NaN, infinities, duplicate keys, bad JSON."""
    return _decode_strict(raw, what, prefix=False)[0]


def loads_strict_prefix(text: str, what: str = "document") -> tuple[Any, int]:
    """The JSON value `text` starts with and the index (in characters) where it ends, as strictly as loads_strict:
    for reading a document field by field, each checked before the next (a larger one) is parsed."""
    return _decode_strict(text, what, prefix=True)


def _decode_strict(raw: bytes | str, what: str, *, prefix: bool) -> tuple[Any, int]:
    seen_non_finite = False

    def constant(literal: str) -> _NonFinite:  # NaN, Infinity, -Infinity
        nonlocal seen_non_finite
        seen_non_finite = True
        return _NonFinite(literal)

    def number(text: str) -> float | _NonFinite:  # 1e999 is no literal, but decodes to infinity
        value = float(text)
        return value if math.isfinite(value) else constant(text)

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise WireFormatError(f"duplicate JSON key {key[:80]!r} in {what}")
            out[key] = value
        return out

    hooks: dict[str, Any] = {
        "parse_constant": constant,
        "parse_float": number,
        "object_pairs_hook": unique_keys,
    }
    try:
        if prefix:
            document, end = json.JSONDecoder(**hooks).raw_decode(
                raw if isinstance(raw, str) else raw.decode()
            )
        else:
            document, end = json.loads(raw, **hooks), len(raw)
    except WireFormatError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise WireFormatError(f"{what} is not valid JSON: {str(exc)[:200]}") from None
    if seen_non_finite:  # only then walk the tree: the placeholder says where the number was
        path, literal = _find_non_finite(document, "") or ("", "?")
        where = f" at {path}" if path else ""
        raise WireFormatError(
            f"{what}{where}: {literal} is not a finite number; only finite numbers are allowed"
        )
    return document, end
