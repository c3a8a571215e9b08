"""Keep-alive HTTP connections to weight sources, each request under the pool's watchdog.

A request's socket is bound to its Watch (watchdog.py) as soon as the TCP connection exists, before any TLS
handshake, response head or body byte, so a cut (a missed deadline, a rate under the floor, a cancelled
fetch or a lost hedge) interrupts whatever blocking read the transfer thread is in. A connection goes back to
the idle list only after a response was read to exactly its announced end; anything else closes it.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from typing import Any
from urllib.parse import urlsplit

from .access import TokenSource, audience_of
from .errors import SourceError
from .watchdog import Watch, Watchdog

IDLE_CONNECTIONS_PER_SOURCE = 16
# What a hostile or broken peer can make http.client and the socket layer raise (ValueError covers
# UnicodeError); our own write errors never happen inside a request, so they are not among these.
NETWORK_ERRORS = (OSError, http.client.HTTPException, ValueError, LookupError)


class ConnectionPool:
    """Keep-alive HTTP connections per source, shared by the transfer threads of one fetch."""

    def __init__(
        self, connect_timeout_s: float, read_timeout_s: float, auth: TokenSource | None = None
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.auth = auth  # signs an access token per server (p2p/weights/access.py); None: anonymous
        self.watchdog = Watchdog()
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None

    def _new(self, source: str, watch: Watch) -> tuple[http.client.HTTPConnection, str]:
        parts = urlsplit(source)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SourceError(f"source {source[:80]!r} is not an http(s) URL")
        https = parts.scheme == "https"
        cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
        conn = cls(parts.hostname, parts.port, timeout=self.connect_timeout_s)
        raw = socket.create_connection(
            (parts.hostname, parts.port or (443 if https else 80)), self.connect_timeout_s
        )
        self.watchdog.attach(watch, raw)  # from here on a cut reaches the socket, even mid-handshake
        raw.settimeout(self.read_timeout_s)  # a silent peer is now a stalled peer
        if https:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            conn.sock = self._tls.wrap_socket(raw, server_hostname=parts.hostname)
        else:
            conn.sock = raw
        return conn, parts.path.rstrip("/")

    def request(
        self, source: str, path: str, headers: dict[str, str], watch: Watch
    ) -> tuple[http.client.HTTPResponse, Any]:
        """GET `path` from `source` under `watch`; returns the response (head read) and a token for `finish`."""
        self.watchdog.watch(watch)
        with self._lock:
            idle = self._idle.get(source, [])
            conn = idle.pop() if idle else None
        parts = urlsplit(source)
        prefix = parts.path.rstrip("/")
        if self.auth is not None:
            headers = {**self.auth.headers(audience_of(parts.hostname, parts.port, parts.scheme)), **headers}
        for fresh in (False, True) if conn is not None else (True,):
            if fresh:
                conn = None
                conn, prefix = self._new(source, watch)
            else:
                assert conn is not None
                self.watchdog.attach(watch, conn.sock)
            try:
                conn.request("GET", prefix + path, headers=headers)
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                conn.close()
                if fresh or watch.reason is not None:
                    raise
                continue  # an idle connection the server had closed: once more on a new one
            except BaseException:
                conn.close()
                raise
            if watch.reason is not None:
                # Cut mid-head: http.client takes the EOF for the end of the headers and returns a response
                # made of whatever arrived. It is not one.
                conn.close()
                raise ConnectionAbortedError(watch.reason)
            watch.body_begins()
            return resp, (source, conn)
        raise AssertionError("unreachable")

    def finish(self, token: Any, watch: Watch, reusable: bool) -> None:
        """End a request: its connection goes back to the idle list only when `reusable` and never cut."""
        self.watchdog.unwatch(watch)
        if token is None:
            return
        source, conn = token
        if not reusable or watch.reason is not None:
            conn.close()
            return
        with self._lock:
            idle = self._idle.setdefault(source, [])
            if len(idle) < IDLE_CONNECTIONS_PER_SOURCE:
                idle.append(conn)
                return
        conn.close()

    def abort(self) -> None:
        """Cut every request in flight, so that threads blocked in a read return at once (cancellation)."""
        self.watchdog.cut_all("the fetch was cancelled")

    def close(self) -> None:
        with self._lock:
            for idle in self._idle.values():
                for conn in idle:
                    conn.close()
            self._idle.clear()
