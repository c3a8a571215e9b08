"""Refuse to start when a port the command will listen on is taken, before anything slow or visible happens.

A server binds its port only after the process has started the DHT and joined the swarm (the contributor's
status API, the validator's API, the trainer's /metrics): a port in use was found tens of seconds late, after
the node had already announced itself, as a traceback from deep inside aiohttp. Each command instead asks
here first, and gets one line naming the port, the flag that sets it and what to do.

The probe binds and listens exactly as the servers will (SO_REUSEADDR, as asyncio sets it on POSIX, so a
port left in TIME_WAIT by a stopped process is not refused), then closes at once. Port 0 (pick a free
port) is never probed. Another process may still take the port in the moment between the probe and the
server's bind; the servers report that case through `port_in_use` too.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import NodeError

# A TCP listen address of the DHT (`--host-maddrs /ip4/0.0.0.0/tcp/31337`); other forms (QUIC, DNS) are
# left to the DHT's own errors.
_TCP_MADDR = re.compile(r"^/ip([46])/([^/]+)/tcp/([0-9]{1,5})(?:/|\Z)")


class PortInUse(NodeError):
    """A port this command must listen on is taken by another process (or not ours to bind)."""


@dataclass(frozen=True)
class Listener:
    """One address the command will listen on, and how the operator changes it."""

    host: str
    port: int
    flag: str  # the flag (or setting) that chooses the port, e.g. "--status-port"
    what: str  # what listens there, e.g. "the status API and /metrics"


def port_in_use(listener: Listener, exc: OSError) -> PortInUse:
    """The one message for a port that cannot be bound, from the probe or from a server's own bind."""
    where = f"{listener.host}:{listener.port}"
    if exc.errno == errno.EADDRINUSE:
        return PortInUse(
            f"port {listener.port} on {listener.host} is already in use ({listener.what}, {listener.flag}); "
            f"stop the process that holds it (`ss -ltnp 'sport = :{listener.port}'` names it) or choose "
            f"another port with {listener.flag}"
        )
    return PortInUse(
        f"cannot listen on {where} ({listener.what}, {listener.flag}): {exc.strerror or exc}; "
        f"choose another address or port"
    )


def dht_listeners(host_maddrs: Iterable[str], flag: str = "--host-maddrs") -> list[Listener]:
    """The TCP ports of the DHT's listen addresses that are fixed (not 0)."""
    found = []
    for maddr in host_maddrs:
        match = _TCP_MADDR.match(maddr)
        if match is not None and int(match.group(3)) != 0:
            found.append(
                Listener(match.group(2), int(match.group(3)), flag, f"the swarm's listen address {maddr}")
            )
    return found


def _probe(listener: Listener) -> None:
    family = socket.AF_INET6 if ":" in listener.host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(
            listener.host, listener.port, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )
    except socket.gaierror:
        return  # an unresolvable host is the server's own error to report, with its own words
    for fam, kind, proto, _, address in infos:
        with socket.socket(fam, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if fam == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
                sock.listen(1)
            except OSError as exc:
                raise port_in_use(listener, exc) from None


def check_ports_free(listeners: Iterable[Listener]) -> None:
    """Raise PortInUse for the first listener whose fixed port cannot be bound now."""
    for listener in listeners:
        if listener.port != 0:
            _probe(listener)
