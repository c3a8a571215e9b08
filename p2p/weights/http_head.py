"""Strict reading of what a weight source says about itself: its URL and the head of each HTTP response.

Everything here is hostile input. Every number goes through the one ASCII-digit parser (p2p/wire.py
`parse_uint`), after only the blanks HTTP allows around a header value are stripped. A header that appears
twice, a body without a Content-Length, or a Transfer-Encoding (no source of ours sends one) are refused,
so the body's length is known and checked before a byte of it is read. Every refusal is a SourceError
naming the header and its value, charged to that source alone.
"""

from __future__ import annotations

import http.client
import re
from urllib.parse import urlsplit

from ..wire import WireFormatError, parse_uint
from .errors import SourceError

# A relay's 503 "come back later" (it has not verified the shard yet) is honoured for up to this long: the
# shard is asked of the other sources meanwhile, and no relay can park a shard for longer.
MAX_NOT_READY_WAIT_S = 5.0
_RETRY_AFTER = re.compile(r"[0-9]{1,30}(?:\.[0-9]{1,6})?")  # capped below, so any length of digits is safe
_OWS = " \t"  # the only whitespace HTTP allows around a header value
MAX_URL_CHARS = 512


def check_source_url(url: str) -> str | None:
    """Why `url` cannot be a weight source (None when it can): an http(s) URL with an ASCII host and a port
    in range. Checked before any connection, so a peer that advertises `http://h:99999` or a non-ASCII
    host costs nothing and raises nothing later."""
    if len(url) > MAX_URL_CHARS or not url.isascii() or not url.isprintable():
        return "not a printable ASCII URL of at most 512 characters"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError when out of range or not a number
    except ValueError as exc:
        return f"not a valid URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not an http(s) URL with a host"
    if port == 0 or parts.query or parts.fragment or parts.username is not None:
        return "has port 0, a query, a fragment or credentials"
    return None


def header_uint(value: str, what: str, maximum: int) -> int:
    """A header's value as a non-negative integer of ASCII digits, at most `maximum`; SourceError otherwise."""
    try:
        return parse_uint(value.strip(_OWS), what, maximum=maximum)
    except WireFormatError as exc:
        raise SourceError(str(exc), corrupt=True) from None


def single_header(resp: http.client.HTTPResponse, name: str) -> str | None:
    """The one value of header `name`, None when absent; a header sent twice is refused."""
    values = resp.headers.get_all(name) or []
    if len(values) > 1:
        raise SourceError(f"sent {len(values)} {name} headers", corrupt=True)
    return values[0] if values else None


def content_length(resp: http.client.HTTPResponse, maximum: int, what: str) -> int:
    """The body's announced length: required, plain, at most `maximum`; no Transfer-Encoding."""
    if resp.headers.get("Transfer-Encoding") is not None:
        raise SourceError(
            f"sent the {what} with a Transfer-Encoding; bodies must carry a Content-Length", corrupt=True
        )
    value = single_header(resp, "Content-Length")
    if value is None:
        raise SourceError(f"sent the {what} without a Content-Length", corrupt=True)
    return header_uint(value, f"Content-Length of the {what}", maximum)


def retry_after(resp: http.client.HTTPResponse) -> float:
    """Seconds a 503 asks us to wait (1 when absent), capped at MAX_NOT_READY_WAIT_S."""
    value = single_header(resp, "Retry-After")
    if value is None:
        return 1.0
    match = _RETRY_AFTER.fullmatch(value.strip(_OWS))
    if match is None:
        raise SourceError(
            f"answered 503 with Retry-After {value[:40]!r}, not a number of seconds in ASCII digits"
        )
    return min(MAX_NOT_READY_WAIT_S, float(match.group(0)))


def content_range(resp: http.client.HTTPResponse, start: int, size: int) -> None:
    """A 206 must say it carries exactly bytes `start`..`size - 1` of a `size`-byte shard."""
    value = single_header(resp, "Content-Range")
    if value is None or value.strip(_OWS) != f"bytes {start}-{size - 1}/{size}":
        shown = "none" if value is None else repr(value[:60])
        raise SourceError(
            f"answered Content-Range {shown} for bytes {start}- of a {size}-byte shard", corrupt=True
        )
