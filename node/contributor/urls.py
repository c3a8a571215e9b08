"""HTTP URLs a node advertises or is given: an unspecified bind host replaced by a routable address.

A server bound to every interface knows itself as http://0.0.0.0:PORT, which no peer can dial. Both the
weights server a node advertises in its heartbeat and the API URL a validator announces are fixed up the
same way: with the first IP address of the libp2p multiaddrs the same signed record carries.
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
