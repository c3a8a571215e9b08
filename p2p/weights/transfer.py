"""One shard from one source: an HTTP (Range) request whose bytes are hashed and written as they arrive.

Each transfer runs on a worker thread with a blocking, keep-alive `http.client` connection: the socket is
read with `readinto` straight into a reused buffer, and the same thread feeds that buffer to SHA-256 and
`pwrite`s it into place. recv, hashing and pwrite all release the GIL, so shards in flight spread over all
cores, with no per-chunk objects and no event-loop hop per chunk (measured: ~30% less CPU per byte than
an asyncio client on loopback). The event loop only schedules shards (fetch.py).

The response is hostile: status, content type and length are checked before the body is read, the body
may not exceed the shard by a byte, reads time out after the stall timeout, redirects are not followed and
nothing is decompressed. A transfer that breaks off keeps the bytes received (they are verified with the
rest of the shard), so the next attempt asks for the remainder with Range.
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
from urllib.parse import urlsplit

from .access import TokenSource, audience_of
from .errors import ManifestError
from .store import PartialVersion, ShardProgress

SHARD_CONTENT_TYPE = "application/octet-stream"
MAX_RETRY_AFTER_S = 5.0
IDLE_CONNECTIONS_PER_SOURCE = 16


class ShardFailure(Exception):
    """A shard transfer failed; `corrupt` when the source sent wrong bytes rather than no bytes."""

    def __init__(self, reason: str, *, corrupt: bool = False, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.corrupt = corrupt
        # Set when a relay answered 503: it has the version but has not verified this shard yet. That is
        # not the source's fault; the fetcher retries after this many seconds without penalising it.
        self.retry_after = retry_after


class TransferCancelled(Exception):
    """The fetch was cancelled while this transfer ran; the thread stopped at a chunk boundary."""


@dataclass
class ShardResult:
    digest: str
    received: int  # bytes received in this attempt (excludes bytes resumed from disk)
    seconds: float


class ConnectionPool:
    """Keep-alive HTTP connections per source, shared by the transfer threads of one fetch."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, auth: TokenSource | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.auth = auth  # signs an access token per server (p2p/weights/access.py); None: anonymous
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._active: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()

    def _new(self, source: str) -> tuple[http.client.HTTPConnection, str]:
        parts = urlsplit(source)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ShardFailure(f"source {source[:80]!r} is not an http(s) URL")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname, parts.port, timeout=self.connect_timeout_s)
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(self.read_timeout_s)  # from now on a silent peer is a stalled peer
        return conn, parts.path.rstrip("/")

    def request(self, source: str, path: str, headers: dict[str, str]) -> tuple[http.client.HTTPResponse, Any]:
        """Send GET `path` to `source`; returns the response and a token to give back with `release`."""
        with self._lock:
            idle = self._idle.get(source, [])
            conn = idle.pop() if idle else None
        parts = urlsplit(source)
        prefix = parts.path.rstrip("/")
        if self.auth is not None:
            headers = {**self.auth.headers(audience_of(parts.hostname, parts.port, parts.scheme)), **headers}
        for fresh in ((False, True) if conn is not None else (True,)):
            if fresh:
                conn, prefix = self._new(source)
            assert conn is not None
            with self._lock:
                self._active.add(conn)
            try:
                conn.request("GET", prefix + path, headers=headers)
                return conn.getresponse(), (source, conn)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                with self._lock:
                    self._active.discard(conn)
                conn.close()
                if fresh:
                    raise
            except BaseException:
                with self._lock:
                    self._active.discard(conn)
                conn.close()
                raise
        raise AssertionError("unreachable")

    def release(self, token: Any, reusable: bool) -> None:
        source, conn = token
        with self._lock:
            self._active.discard(conn)
        if not reusable:
            conn.close()
            return
        with self._lock:
            idle = self._idle.setdefault(source, [])
            if len(idle) < IDLE_CONNECTIONS_PER_SOURCE:
                idle.append(conn)
                return
        conn.close()

    def abort(self) -> None:
        """Cut every connection in use, so that threads blocked in a read return at once (cancellation)."""
        with self._lock:
            active = list(self._active)
        for conn in active:
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            for idle in self._idle.values():
                for conn in idle:
                    conn.close()
            self._idle.clear()


def shard_path(step: int, index: int) -> str:
    return f"/v1/weights/{step}/shards/{index}"


def _rehash(partial: PartialVersion, index: int, length: int) -> Any:
    """Rebuild the hash state of the first `length` bytes already on disk (a resumed shard)."""
    h = hashlib.sha256()
    pos = 0
    while pos < length:
        block = partial.read(index, pos, min(8 << 20, length - pos))
        if not block:
            break
        h.update(block)
        pos += len(block)
    return h


def download_shard(
    pool: ConnectionPool,
    source: str,
    partial: PartialVersion,
    index: int,
    progress: ShardProgress,
    *,
    chunk_bytes: int,
    cancelled: threading.Event,
    on_bytes: Callable[[int], None] | None = None,
) -> ShardResult:
    """Blocking: fetch shard `index` from `source` into `partial`, resuming after `progress.done_bytes`."""
    entry = partial.manifest.body.shards[index]
    start = progress.done_bytes
    hasher = _rehash(partial, index, start) if start else hashlib.sha256()
    headers = {"Range": f"bytes={start}-"} if start else {}
    began = time.monotonic()
    received = 0
    token: Any = None
    reusable = False
    try:
        resp, token = pool.request(source, shard_path(partial.manifest.step, index), headers)
        _check_response(resp, start, entry.size)
        announced = resp.getheader("Content-Length") is not None
        buf = memoryview(bytearray(min(chunk_bytes, entry.size - start + 1)))
        offset = start
        while True:
            if cancelled.is_set():
                raise TransferCancelled()
            # Ask for one byte more than the shard can still hold, so that an oversized body is seen.
            n = resp.readinto(buf[: min(len(buf), entry.size - offset + 1)])
            if not n:
                break
            if offset + n > entry.size:
                raise ShardFailure(f"shard {index}: source sent more than the {entry.size} bytes signed", corrupt=True)
            piece = buf[:n]
            hasher.update(piece)
            partial.write(index, offset, piece)
            offset += n
            received += n
            progress.done_bytes = offset  # only after the bytes are written: the journal never runs ahead
            if on_bytes is not None:
                on_bytes(n)
        reusable = offset == entry.size and not resp.will_close
    except socket.timeout:
        raise ShardFailure(f"shard {index}: source stalled (no data within the stall timeout)") from None
    except (http.client.HTTPException, OSError) as exc:
        raise ShardFailure(f"shard {index}: transfer failed: {type(exc).__name__}: {str(exc)[:120]}") from None
    finally:
        if token is not None:
            pool.release(token, reusable)
    if progress.done_bytes != entry.size:
        # The body ended early. Short of its Content-Length it is a cut connection (resumable); a chunked body
        # that ended cleanly is the source claiming a complete shard of the wrong length.
        raise ShardFailure(f"shard {index}: source ended after {progress.done_bytes} of {entry.size} bytes",
                           corrupt=not announced and bool(resp.chunked))
    digest = hasher.hexdigest()
    if digest != entry.sha256:
        raise ShardFailure(f"shard {index}: SHA-256 mismatch (got {digest[:16]}…, signed {entry.sha256[:16]}…)", corrupt=True)
    return ShardResult(digest=digest, received=received, seconds=time.monotonic() - began)


def _check_response(resp: http.client.HTTPResponse, start: int, size: int) -> None:
    expected_status = 206 if start else 200
    if resp.status == 503:
        try:
            retry_after = min(MAX_RETRY_AFTER_S, max(0.0, float(resp.getheader("Retry-After", "1") or "1")))
        except ValueError:
            retry_after = 1.0
        raise ShardFailure("source has not verified this shard yet (503)", retry_after=retry_after)
    if resp.status != expected_status:
        raise ShardFailure(f"source answered HTTP {resp.status} (expected {expected_status})")
    ctype = resp.getheader("Content-Type", "") or ""
    if ctype.split(";")[0].strip() != SHARD_CONTENT_TYPE:
        raise ShardFailure(f"source answered content type {ctype[:60]!r}, not {SHARD_CONTENT_TYPE}")
    if resp.getheader("Content-Encoding", "identity") not in ("identity", ""):
        raise ShardFailure("source answered an encoded (compressed) body; shards are sent as they are", corrupt=True)
    if start:
        content_range = resp.getheader("Content-Range", "") or ""
        if content_range != f"bytes {start}-{size - 1}/{size}":
            raise ShardFailure(f"source answered Content-Range {content_range[:60]!r} for bytes {start}-", corrupt=True)
    length = resp.getheader("Content-Length")
    if length is not None and length.strip() != str(size - start):
        raise ShardFailure(f"source announced {length[:20]} bytes, the signed shard has {size - start}", corrupt=True)


def fetch_document(pool: ConnectionPool, source: str, path: str, limit: int, timeout_s: float) -> bytes:
    """Blocking GET of a small JSON document (a manifest): at most `limit` bytes within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    token: Any = None
    reusable = False
    try:
        resp, token = pool.request(source, path, {})
        if resp.status != 200:
            raise ManifestError(f"answered HTTP {resp.status} for the manifest")
        length = resp.getheader("Content-Length")
        if length is not None and (not length.strip().isdigit() or int(length) > limit):
            raise ManifestError(f"manifest is {length[:20]} bytes, over the {limit}-byte limit")
        body = bytearray()
        while True:
            if time.monotonic() > deadline:
                raise ManifestError(f"timed out serving the manifest (over {timeout_s:g} s)")
            block = resp.read(min(1 << 16, limit + 1 - len(body)))
            if not block:
                break
            body += block
            if len(body) > limit:
                raise ManifestError(f"manifest is over the {limit}-byte limit")
        reusable = not resp.will_close
        return bytes(body)
    except ShardFailure as exc:
        raise ManifestError(exc.reason) from None
    except socket.timeout:
        raise ManifestError("timed out serving the manifest") from None
    except (http.client.HTTPException, OSError) as exc:
        raise ManifestError(f"unreachable: {type(exc).__name__}: {str(exc)[:120]}") from None
    finally:
        if token is not None:
            pool.release(token, reusable)
