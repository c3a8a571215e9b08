"""HTTP URLs a node advertises or is given: an unspecified bind host replaced by a routable address.

A server bound to every interface knows itself as http://0.0.0.0:PORT, which no peer can dial. The weights
server a node advertises in its heartbeat, the API URL a validator announces and the trainer's weights URL
are fixed up the same way: with the first IP address of the libp2p multiaddrs the node announces (its
`--announce-maddrs`, or what the same signed record carries). Every role uses it, so it lives here.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit, urlunsplit

_UNSPECIFIED = {"", "0.0.0.0", "::"}
_MADDR_IP = re.compile(r"^/(ip4|ip6)/([^/]+)/")


def routable_url(url: str, maddrs: list[str]) -> str | None:
    """`url` with an unspecified host replaced by the first IP of `maddrs`; None when there is none, or
    when `url` cannot be parsed (e.g. an unbracketed IPv6 host)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if (parts.hostname or "") not in _UNSPECIFIED:
        return urlunsplit(parts).rstrip("/")
    for maddr in maddrs:
        match = _MADDR_IP.match(maddr)
        if match is None:
            continue
        try:
            ip = ipaddress.ip_address(match.group(2))
        except ValueError:
            continue
        if ip.is_unspecified:
            continue
        host = f"[{ip}]" if ip.version == 6 else str(ip)
        return urlunsplit(parts._replace(netloc=host + (f":{port}" if port else ""))).rstrip("/")
    return None


def loopback_behind(url: str, announced: list[str]) -> str | None:
    """The first address of `announced` (multiaddrs) that is not loopback, when `url`'s host is: peers on
    other machines are then told to dial that address but cannot reach `url` (a server left on its default
    127.0.0.1). None when `url` is not on loopback or nothing else is announced."""
    try:
        host = urlsplit(url).hostname or ""
        on_loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return None
    if not on_loopback:
        return None
    for maddr in announced:
        match = _MADDR_IP.match(maddr)
        try:
            if match is not None and not ipaddress.ip_address(match.group(2)).is_loopback:
                return maddr
        except ValueError:
            continue
    return None
