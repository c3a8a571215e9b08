"""One request to one source: a shard (or part of one) hashed and written as it arrives, or a manifest.

Each transfer runs on a worker thread with a blocking, keep-alive `http.client` connection (connections.py).
The body is read straight into a reused buffer, one socket read at a time (`readinto1`), so the request's
Watch sees every arrival (its deadline and throughput floor, watchdog.py), and the same thread feeds each
filled buffer to SHA-256 and to its sink (the partial version's files, or a hedge's side file). recv, hashing
and pwrite all release the GIL, so shards in flight spread over all cores with no event-loop hop per chunk.

The response is hostile: status, content type and every number in the head are checked strictly (http_head.py)
before the body is read, the body is read to exactly its announced length (which must be the signed one),
redirects are not followed and nothing is decompressed. What a source can make go wrong raises SourceError
(charged to that source); only a failure to write our own disk raises StoreError. A transfer that breaks off
keeps the bytes received (they are verified with the rest of the shard), so the same source's next attempt
asks for the remainder with Range (attempts.py: no other source ever continues them).
"""

from __future__ import annotations

import hashlib
import http.client
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..wire import WireFormatError, loads_strict
from . import http_head
from .connections import NETWORK_ERRORS, ConnectionPool
from .errors import ManifestAbsent, ManifestError, SourceError, SourceUnreachable, StoreError
from .manifest import MAX_SHARD_SIZE, MAX_SHARDS
from .seeding import SEED_HEADER
from .store import PartialVersion
from .watchdog import Watch

SHARD_CONTENT_TYPE = "application/octet-stream"


BUSY_HEADER = "X-Prime-Node-Busy"  # on a 503: the server holds the shard but has no free upload slot
# A 404's body that says the whole version is gone (server.py answers this for an unknown step), as opposed to
# one shard; read only when it is at most MAX_REFUSAL_BYTES, and compared after strict JSON decoding.
VERSION_ABSENT = {"error": "no such version"}
MAX_REFUSAL_BYTES = 256


class ShardFailure(SourceError):
    """A shard transfer failed through its source; `corrupt` when it sent wrong bytes rather than no bytes;
    `busy` for a 503 that says every upload slot was taken (the source is paused, not only the shard);
    `withdrawn` for a 404 that says the source no longer serves the version at all (it dropped or pruned it);
    `instead` for a 503 of a super-seeding origin, naming the shard to ask it for instead."""

    busy = False
    withdrawn = False
    instead: int | None = None  # on a super-seeding origin's 503: a shard it has not sent yet (seeding.py)


class DigestMismatch(ShardFailure):
    """Every byte of the shard arrived, and their SHA-256 is not the signed one."""


class TransferCancelled(Exception):
    """The transfer was cancelled (a lost hedge, a cancelled fetch); its thread stopped at a chunk boundary."""


@dataclass
class ShardResult:
    digest: str
    received: int  # bytes received in this attempt (excludes bytes resumed from disk)
    seconds: float


def shard_path(step: int, index: int) -> str:
    return f"/v1/weights/{step}/shards/{index}"


def rehash(partial: PartialVersion, index: int, length: int) -> Any:
    """The hash state of the first `length` bytes of shard `index` already on disk (a resumed shard)."""
    h = hashlib.sha256()
    pos = 0
    while pos < length:
        block = partial.read(index, pos, min(8 << 20, length - pos))
        if not block:
            break
        h.update(block)
        pos += len(block)
    return h


def _fill(resp: http.client.HTTPResponse, view: memoryview, watch: Watch) -> tuple[int, BaseException | None]:
    """Read into `view` one socket read at a time; returns the bytes read and the error that stopped it, if any."""
    fp = resp.fp
    filled = 0
    try:
        while filled < len(view) and fp is not None:
            # readinto1: at most one recv per call, so a drip-feeding source shows as the trickle it is.
            n = fp.readinto1(view[filled:])
            if not n:
                break
            filled += n
            watch.received += n
    except NETWORK_ERRORS as exc:
        return filled, exc
    return filled, None


def _reason(watch: Watch, error: BaseException | None) -> str:
    """Why a request broke: the watchdog's reason first (its cut caused the error), else the error's."""
    if watch.reason is not None:
        return watch.reason
    if isinstance(error, socket.timeout):
        return "source stalled (no data within the stall timeout)"
    if error is None:
        return "source closed the connection before the end of the body"
    return f"request failed: {type(error).__name__}: {str(error)[:120]}"


def _failure(watch: Watch, error: BaseException | None, cancelled: threading.Event) -> Exception:
    if cancelled.is_set() or watch.cancelled:
        return TransferCancelled()
    return ShardFailure(_reason(watch, error))


def _refusal(resp: http.client.HTTPResponse, watch: Watch) -> object:
    """The JSON body of a refusal (at most MAX_REFUSAL_BYTES, read under the request's watch), strictly
    decoded; None when there is no such body to read."""
    try:
        length = http_head.content_length(resp, MAX_REFUSAL_BYTES, "refusal")
    except SourceError:
        return None
    body = bytearray(length)
    filled, error = _fill(resp, memoryview(body), watch)
    if error is not None or filled < length:
        return None
    try:
        return loads_strict(bytes(body), "refusal")
    except WireFormatError:
        return None


def _check_head(resp: http.client.HTTPResponse, start: int, size: int, watch: Watch) -> None:
    if resp.status == 404 and _refusal(resp, watch) == VERSION_ABSENT:
        failure = ShardFailure("source no longer serves this version (404 no such version)", status=404)
        failure.withdrawn = True
        raise failure
    if resp.status == 503:
        busy = resp.getheader(BUSY_HEADER) is not None
        failure = ShardFailure(
            "source has no free upload slot (503)"
            if busy
            else "source has not verified this shard yet (503)",
            retry_after=http_head.retry_after(resp),
            status=503,
        )
        failure.busy = busy
        seed = http_head.single_header(resp, SEED_HEADER)
        if (
            seed is not None
        ):  # an origin super-seeding (seeding.py): this shard went out already, ask for that one
            failure.instead = http_head.header_uint(seed, SEED_HEADER, MAX_SHARDS - 1)
        raise failure
    expected = 206 if start else 200
    if resp.status != expected:
        raise ShardFailure(f"source answered HTTP {resp.status} (expected {expected})", status=resp.status)
    ctype = resp.getheader("Content-Type", "") or ""
    if ctype.split(";")[0].strip() != SHARD_CONTENT_TYPE:
        raise ShardFailure(f"source answered content type {ctype[:60]!r}, not {SHARD_CONTENT_TYPE}")
    if resp.getheader("Content-Encoding", "identity") not in ("identity", ""):
        raise ShardFailure(
            "source answered an encoded (compressed) body; shards are sent as they are", corrupt=True
        )
    if start:
        http_head.content_range(resp, start, size)
    length = http_head.content_length(resp, MAX_SHARD_SIZE, "shard")
    if length != size - start:
        raise ShardFailure(
            f"source announced {length} bytes, the signed shard has {size - start} from byte {start}",
            corrupt=True,
        )


def download_shard(
    pool: ConnectionPool,
    source: str,
    path: str,
    *,
    size: int,
    sha256: str,
    start: int,
    hasher: Any,
    sink: Callable[[int, memoryview], None],
    watch: Watch,
    cancelled: threading.Event,
    chunk_bytes: int,
    on_chunk: Callable[[int, int], None] | None = None,
) -> ShardResult:
    """Blocking: fetch bytes `start`.. of a `size`-byte shard from `source` into `sink(offset, bytes)`, hashing
    them after `hasher`'s state (the bytes before `start`); `on_chunk(new_offset, n)` follows each write."""
    began = time.monotonic()
    token: Any = None
    reusable = False
    offset = start
    try:
        try:
            resp, token = pool.request(source, path, {"Range": f"bytes={start}-"} if start else {}, watch)
            _check_head(resp, start, size, watch)
        except SourceError:
            raise
        except NETWORK_ERRORS as exc:
            raise _failure(watch, exc, cancelled) from None
        buf = memoryview(bytearray(min(chunk_bytes, size - start)))
        while offset < size:
            want = min(len(buf), size - offset)
            filled, error = _fill(resp, buf[:want], watch)
            if cancelled.is_set() or watch.cancelled:
                raise TransferCancelled()  # at a chunk boundary: nothing more is written
            if filled:
                piece = buf[:filled]
                hasher.update(piece)
                try:
                    sink(offset, piece)
                except OSError as exc:  # our disk, not the source: the fetch stops with this
                    raise StoreError(f"cannot write the checkpoint to disk: {exc}") from exc
                offset += filled
                if on_chunk is not None:
                    on_chunk(offset, filled)
            if error is not None or filled < want:
                if error is None and watch.reason is None and not cancelled.is_set():
                    raise ShardFailure(f"source ended after {offset} of {size} bytes")
                raise _failure(watch, error, cancelled)
        resp.close()  # read to exactly its announced end: the connection can carry the next request
        reusable = not resp.will_close
    finally:
        pool.finish(token, watch, reusable)
    digest = hasher.hexdigest()
    if digest != sha256:
        raise DigestMismatch(f"SHA-256 mismatch (got {digest[:16]}…, signed {sha256[:16]}…)", corrupt=True)
    return ShardResult(digest=digest, received=offset - start, seconds=time.monotonic() - began)


def fetch_document(pool: ConnectionPool, source: str, path: str, limit: int, timeout_s: float) -> bytes:
    """Blocking GET of a small JSON document (a manifest, an availability record): at most `limit` bytes, all
    of it within `timeout_s` of wall-clock time however the source paces it. ManifestAbsent for 404 and 503,
    SourceUnreachable when no response head came (refused, reset, cut or timed out)."""
    watch = Watch(deadline_s=timeout_s)
    token: Any = None
    reusable = False
    try:
        try:
            resp, token = pool.request(source, path, {}, watch)
        except (
            OSError
        ) as exc:  # a refused, reset or timed-out connection; not a malformed answer (HTTPException)
            raise SourceUnreachable(_reason(watch, exc)) from None
        if resp.status in (404, 503):
            raise ManifestAbsent(f"answered HTTP {resp.status} for {path}", resp.status)
        if resp.status != 200:
            raise ManifestError(f"answered HTTP {resp.status} for {path}")
        length = http_head.content_length(resp, limit, "manifest")
        body = bytearray(length)
        filled, error = _fill(resp, memoryview(body), watch)
        if error is not None or filled < length:
            raise ManifestError(f"{_reason(watch, error)} (after {filled} of {length} manifest bytes)")
        resp.close()
        reusable = not resp.will_close
        return bytes(body)
    except SourceError as exc:
        raise ManifestError(exc.reason) from None
    except NETWORK_ERRORS as exc:
        raise ManifestError(_reason(watch, exc)) from None
    finally:
        pool.finish(token, watch, reusable)
