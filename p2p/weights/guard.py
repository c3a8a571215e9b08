"""What one client can hold of a weights server: connections, time to send a request, time to read a response.

A weights server (the trainer's origin, relays, nodes that serve their checkpoints) answers anyone who can
reach it, and a connection costs it a socket, a coroutine and, while a shard is sent, an open file. A
request rate limit does not bound any of that: a client that opens connections and never finishes a request
head, or asks for a shard and never reads it, holds them for free. So every connection is admitted here:

  * at most `max_connections` at once, and `max_connections_per_ip` from one address; a connection over either
    is closed at once, before a byte is read;
  * a request head must be complete within `header_timeout_s` of the connection opening or of the previous
    response ending (a keep-alive connection is a fresh wait for the next head);
  * a response must be read at `min_send_rate_bytes_s`: its wall-clock deadline is `send_grace_s` plus its
    size at that rate, past which the connection is reset (and the file it was reading closed).

A client that goes away mid-response (a reset, a broken pipe) is its own business: logged at debug level,
never as an error with a traceback.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

# What a client that went away makes a write raise: ConnectionError covers resets, broken pipes and aiohttp's
# ClientConnectionResetError; a transport already closed raises RuntimeError from some asyncio paths.
CLIENT_GONE = (ConnectionError, RuntimeError)


# An IPv6 subscriber is given a whole /64 (RFC 6177), so one client counted by its full address could take a
# server's per-client share once per address it picks there. IPv4 addresses are scarce enough to count alone.
IPV6_CLIENT_PREFIX = 64


def client_of(address: str | None) -> str:
    """The client an address stands for, as the per-client limits count it: an IPv4 address itself (also when
    IPv4-mapped), an IPv6 address's /64, "?" for no address; an address that does not parse counts as itself."""
    if not address:
        return "?"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, IPV6_CLIENT_PREFIX), strict=False))
    return str(ip)


class ServeLimits(BaseModel):
    """Bounds on what clients can hold of a weights server (a section of ServeSettings)."""

    model_config = ConfigDict(extra="forbid")

    max_connections: int = Field(
        512,
        ge=1,
        le=65536,
        description="Connections served at once from all clients; more are closed at once.",
    )
    max_connections_per_ip: int = Field(
        32,
        ge=1,
        le=65536,
        description="Connections served at once from one client (an IPv4 address, an IPv6 address's /64).",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="A request head must be complete within this of the connection opening or of the "
        "previous response ending.",
    )
    min_send_rate_bytes_s: int = Field(
        64 << 10,
        ge=1,
        description="Slowest a client may read a response: its deadline is send_grace_s plus its size at this.",
    )
    send_grace_s: float = Field(
        10.0, gt=0, le=600, description="Time allowed for a response beyond its size at the minimum rate."
    )

    def send_deadline_s(self, size: int) -> float:
        return self.send_grace_s + size / self.min_send_rate_bytes_s


class _Connection(asyncio.Protocol):
    """One admitted connection: the guard's timers, in front of aiohttp's own protocol for it."""

    def __init__(self, guard: ConnectionGuard, make_inner: Callable[[], Any]) -> None:
        self.guard = guard
        self._make_inner = make_inner
        self.inner: Any = None  # aiohttp's RequestHandler for this connection, once admitted
        self.ip = "?"
        self.admitted = False
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    # ---- the transport's calls, passed on to aiohttp ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.ip = client_of(str(peer[0])) if isinstance(peer, tuple) and peer else "?"
        refusal = self.guard.admit(self)
        if refusal is not None:
            logger.debug("refused a connection from %s: %s", self.ip, refusal)
            transport.abort()
            return
        self.admitted = True
        self.inner = self._make_inner()
        self.inner.connection_made(transport)
        self.awaiting_head()

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self.admitted:
            self.admitted = False
            self.guard.release(self)
            self.inner.connection_lost(exc)

    # ---- the guard's timers --------------------------------------------------------------------------------

    def awaiting_head(self) -> None:
        """The next request head is due within the header timeout."""
        timeout = self.guard.limits.header_timeout_s
        self._arm(timeout, f"sent no complete request head within {timeout:g} s")

    def handling(self) -> None:
        """A request head arrived: its handler runs (its own waits are bounded; sending is, by `send`)."""
        self._cancel_timer()

    def _arm(self, seconds: float, why: str) -> None:
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._cut, why)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cut(self, why: str) -> None:
        self._timer = None
        logger.debug("closing the connection from %s: it %s", self.ip, why)
        if self.transport is not None:
            self.transport.abort()


class ConnectionGuard:
    """Admits connections within the caps and bounds each one's waits; see the module docstring."""

    def __init__(self, limits: ServeLimits) -> None:
        self.limits = limits
        self.open = 0
        self.per_ip: collections.Counter[str] = collections.Counter()
        self.refused = 0  # connections closed at once for being over a cap (tests and status read it)
        self._by_transport: dict[int, _Connection] = {}

    def protocol(self, make_inner: Callable[[], Any]) -> _Connection:
        return _Connection(self, make_inner)

    def admit(self, conn: _Connection) -> str | None:
        """Count `conn` in, or say why it is refused."""
        if self.open >= self.limits.max_connections:
            self.refused += 1
            return f"{self.open} connections are open, the most this server takes"
        if self.per_ip[conn.ip] >= self.limits.max_connections_per_ip:
            self.refused += 1
            return f"{self.per_ip[conn.ip]} connections from that address are open, the most it may hold"
        self.open += 1
        self.per_ip[conn.ip] += 1
        assert conn.transport is not None
        self._by_transport[id(conn.transport)] = conn
        return None

    def release(self, conn: _Connection) -> None:
        self.open -= 1
        self.per_ip[conn.ip] -= 1
        if self.per_ip[conn.ip] <= 0:
            del self.per_ip[conn.ip]
        if conn.transport is not None:
            self._by_transport.pop(id(conn.transport), None)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Outermost: stops the header timer while a request is handled, sends a response the handler did
        not send itself under its deadline, and starts the wait for the next head."""
        conn = self._by_transport.get(id(request.transport)) if request.transport is not None else None
        if conn is not None:
            conn.handling()
        try:
            try:
                response = await handler(request)
            except web.HTTPException as exc:  # an error answer is sent like any other, then raised on
                await self._send_whole(request, exc)
                raise
            await self._send_whole(request, response)
            return response
        finally:
            if conn is not None and conn.admitted:
                conn.awaiting_head()

    async def _send_whole(self, request: web.Request, response: web.StreamResponse) -> None:
        """Send a response the handler built but did not send (a JSON document, an error) under its deadline."""
        if response.prepared:
            return
        body = getattr(response, "body", None)
        size = len(body) if isinstance(body, (bytes, bytearray)) else 0
        await self.send(request, response, size, response.write_eof)

    async def send(
        self,
        request: web.Request,
        response: web.StreamResponse,
        size: int,
        write: Callable[[], Awaitable[None]],
    ) -> bool:
        """Prepare `response` and run `write` (its `size` bytes of body) within the response's deadline; the
        transport is aborted past it. False when the client went away or was cut (it is logged at debug)."""
        deadline = self.limits.send_deadline_s(size)
        try:
            async with asyncio.timeout(deadline):
                await response.prepare(request)
                await write()
            return True
        except TimeoutError:
            logger.debug(
                "cut %s: it did not read %d bytes of %s within %.1f s",
                request.remote,
                size,
                request.path[:80],
                deadline,
            )
            if request.transport is not None:
                reset(request.transport)
        except CLIENT_GONE as exc:
            logger.debug("client %s went away during %s: %r", request.remote, request.path[:80], exc)
        return False


def reset(transport: asyncio.BaseTransport) -> None:
    """Abort with a TCP reset. A plain close would leave the kernel holding the unsent part of the response
    (up to the socket's send buffer) for a peer that never reads it, retransmitting for minutes."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already closed: the abort below is all there is to do
    if isinstance(transport, asyncio.Transport):
        transport.abort()
    else:
        transport.close()


class GuardedSite(web.BaseSite):
    """A TCP site whose every connection goes through a ConnectionGuard."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    @property
    def sockets(self) -> list[Any]:
        return list(self._server.sockets) if isinstance(self._server, asyncio.Server) else []

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self._guard.protocol(server), self._host, self._port, backlog=128, reuse_address=True
        )
