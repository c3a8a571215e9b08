"""Who may download from a weights server: signed access tokens and a ban list (node ids, addresses,
networks); the per-client rate limit is p2p/rate_limit.py.

A fetcher with an identity proves who it is with an access token in the X-Prime-Node-Auth header:
`<node id>.<unix time>.<signature>`, an Ed25519 signature over a domain tag, the node id, the time and the
audience (the server's host:port as the client addressed it). A server accepts only tokens addressed to
one of its own names (what it bound, plus its configured public URLs), never to whatever Host header a
request carries, so a server that received a token cannot replay it elsewhere; the time bounds how long a
token lives (TOKEN_LIFETIME_S either way, to allow for clock skew). Node-id bans apply to the id a token
proved, never to an unproven claim, so a banned node cannot lift its ban by omitting or changing a header: a
server that sets `require_node_auth` refuses anonymous requests (401), and one that does not still refuses
the banned id whenever it is presented. Address bans are enforced on the TCP peer address.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from pathlib import Path

import psutil

from ..identity import Identity
from ..signing import SignatureError, verify_signature
from ..wire import WireFormatError, is_hex64, parse_uint
from .errors import WeightsError

logger = logging.getLogger(__name__)


AUTH_HEADER = "X-Prime-Node-Auth"
TOKEN_LIFETIME_S = 300
_TOKEN_DOMAIN = b"prime-node/weights-access/v1\x00"
_MAX_TOKEN_CHARS = 64 + 1 + 12 + 1 + 128  # node id . time . signature: anything longer is refused unread
_MAX_TOKEN_TIME = 10**12 - 1  # twelve digits: year 33658, far past any clock we accept


class AccessDenied(WeightsError):
    """An access token that is malformed, expired, addressed to another server, or badly signed."""


def audience_of(host: str | None, port: int | None, scheme: str = "http") -> str:
    """The canonical `host:port` a token is bound to (the default port filled in, the host lower-cased)."""
    default = 443 if scheme == "https" else 80
    return f"{(host or '').lower().strip('[]')}:{port or default}"


def own_audiences(configured_host: str, bound: list[tuple[str, int]], port: int) -> set[str]:
    """The `host:port` names a server answers to: what it bound, every local address when it bound an
    unspecified one (0.0.0.0, ::), and `localhost` next to a loopback address."""
    hosts = {configured_host}
    for address, _ in bound:
        ip = ipaddress.ip_address(address.split("%")[0])
        if ip.is_unspecified:
            hosts.update(
                a.address.split("%")[0]
                for addrs in psutil.net_if_addrs().values()
                for a in addrs
                if a.family in (socket.AF_INET, socket.AF_INET6)
            )
        hosts.add(str(ip))
    if any(_is_loopback(h) for h in hosts):
        hosts.update({"localhost", "127.0.0.1", "::1"})
    return {audience_of(h, port) for h in hosts}


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _token_message(node_id: str, issued: int, audience: str) -> bytes:
    return _TOKEN_DOMAIN + f"{node_id}\x00{issued}\x00{audience}".encode()


def make_access_token(identity: Identity, audience: str, now: float | None = None) -> str:
    issued = int(time.time() if now is None else now)
    signature = identity.sign(_token_message(identity.node_id, issued, audience))
    return f"{identity.node_id}.{issued}.{signature.hex()}"


def verify_access_token(token: str, audience: str, now: float | None = None) -> str:
    """The node id the token proves, or AccessDenied naming what is wrong with it."""
    if len(token) > _MAX_TOKEN_CHARS:
        raise AccessDenied(f"access token is {len(token)} characters, more than {_MAX_TOKEN_CHARS}")
    parts = token.split(".")
    shape = "access token must be <node id hex>.<unix time>.<signature hex>"
    if len(parts) != 3 or not is_hex64(parts[0]) or len(parts[2]) != 128:
        raise AccessDenied(shape)
    try:
        issued = parse_uint(parts[1], "access token time", maximum=_MAX_TOKEN_TIME)
    except WireFormatError as exc:
        raise AccessDenied(f"{shape}: {exc}") from None
    node_id = parts[0]
    try:
        signature = bytes.fromhex(parts[2])
    except ValueError:
        raise AccessDenied("access token signature is not hex") from None
    age = (time.time() if now is None else now) - issued
    if abs(age) > TOKEN_LIFETIME_S:
        raise AccessDenied(
            f"access token issued {age:.0f} s from now; tokens live {TOKEN_LIFETIME_S} s (check the clock)"
        )
    try:
        verify_signature(node_id, _token_message(node_id, issued, audience), signature)
    except SignatureError:
        raise AccessDenied(
            f"access token signature does not verify for node {node_id[:16]}… at {audience}"
        ) from None
    return node_id


class TokenSource:
    """Access-token headers for a fetcher, one cached token per audience, renewed well before expiry."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self._cache: dict[str, tuple[float, str]] = {}

    def headers(self, audience: str) -> dict[str, str]:
        now = time.time()
        cached = self._cache.get(audience)
        if cached is None or now - cached[0] > TOKEN_LIFETIME_S / 3:
            cached = (now, make_access_token(self.identity, audience, now))
            self._cache[audience] = cached
        return {AUTH_HEADER: cached[1]}


class BanList:
    """Banned node ids and IP networks, from flags and an optional file re-read when it changes."""

    def __init__(self, entries: list[str] | None = None, path: Path | None = None) -> None:
        self.path = path
        self._static = list(entries or [])
        self._mtime: float | None = None
        self._dynamic: set[str] = set()
        self.node_ids: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self._apply(self._static)
        self.reload()

    def set_dynamic(self, node_ids: set[str]) -> None:
        """Node ids banned from elsewhere (the operator's signed bans in the DHT), replacing the previous set."""
        self._dynamic = {n.lower() for n in node_ids if is_hex64(n.lower())}

    def _apply(self, entries: list[str]) -> None:
        node_ids, networks = set(), []
        for raw in entries:
            entry = raw.split("#", 1)[0].strip().lower()
            if not entry:
                continue
            if is_hex64(entry):
                node_ids.add(entry)
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise WeightsError(
                    f"ban entry {raw.strip()[:80]!r} is neither a node id (64 hex) nor an IP or network"
                ) from None
        self.node_ids, self.networks = node_ids, networks

    def reload(self) -> None:
        """Re-read the ban file if it changed (called periodically by the server)."""
        if self.path is None:
            return
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self._mtime:
            return
        lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        self._apply(self._static + lines)
        self._mtime = mtime
        logger.info(
            "ban list %s: %d node ids, %d networks", self.path, len(self.node_ids), len(self.networks)
        )

    def is_banned(self, address: str | None, node_id: str | None) -> bool:
        if node_id and (node_id.lower() in self.node_ids or node_id.lower() in self._dynamic):
            return True
        if not address:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self.networks)
