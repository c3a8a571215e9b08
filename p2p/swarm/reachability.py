"""Can this node be dialled? A dial-back self-test run at start against a bootstrap peer.

Every full peer serves a small dial-back protocol: the asker names up to four TCP ports and the peer
tries a fresh TCP connection to each of them on the IP address it observes the asker's stream coming
from. Only the port is chosen by the asker, never the address, so a peer cannot be used to probe third
parties (the same rule as libp2p's AutoNAT). An existing libp2p connection proves nothing: it was opened
by us, and the NAT lets its replies through whether or not the port is forwarded.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from .errors import HandoffError
from .framing import close_writer, read_frame, write_frame

logger = logging.getLogger(__name__)

MAX_PROBE_PORTS = 4
PROBE_ROUNDS = 2  # rounds over the bootstrap peers: a first stream includes the connection's set-up
_MAX_FRAME = 512


def protocol_name(run_id: str) -> str:
    return f"/prime-node/{run_id}/dialback/1"


def tcp_ports(maddrs: list[str]) -> list[int]:
    """The distinct TCP ports in `maddrs`, in order."""
    ports: list[int] = []
    for text in maddrs:
        maddr = Multiaddr(text)
        if "tcp" in maddr:
            port = int(maddr["tcp"])
            if port and port not in ports:
                ports.append(port)
    return ports[:MAX_PROBE_PORTS]


def _observed_host(addr: Multiaddr) -> str | None:
    for proto in ("ip4", "ip6"):
        if proto in addr:
            return str(addr[proto])
    return None


class DialBackServer:
    """Serves dial-back probes for other peers; a bounded number at a time."""

    def __init__(self, run_id: str, timeout_s: float, max_concurrent: int = 8) -> None:
        self.name = protocol_name(run_id)
        self._timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max_concurrent)

    async def handle(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            request = await read_frame(reader, _MAX_FRAME, self._timeout_s)
            ports = request.get("ports") if isinstance(request, dict) else None
            if (
                not isinstance(ports, list)
                or not 0 < len(ports) <= MAX_PROBE_PORTS
                or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)
            ):
                await write_frame(writer, {"error": f"'ports' must list 1 to {MAX_PROBE_PORTS} TCP ports"})
                return
            host = _observed_host(info.addr)
            if host is None:  # e.g. a relayed stream: there is no address to dial back
                await write_frame(writer, {"error": f"no IP address observed for the stream ({info.addr})"})
                return
            async with self._slots:
                results = await asyncio.gather(*(self._dial(host, port) for port in ports))
            await write_frame(
                writer, {"reachable": [p for p, ok in zip(ports, results, strict=True) if ok], "host": host}
            )
        except HandoffError as exc:
            logger.debug("dial-back request from %s failed: %s", info.peer_id, exc)
        finally:
            close_writer(writer)

    async def _dial(self, host: str, port: int) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self._timeout_s)
        except (TimeoutError, OSError):
            return False
        close_writer(writer)
        return True


async def probe(p2p: P2P, run_id: str, helpers: list[str], ports: list[int], timeout_s: float) -> bool | None:
    """Ask the peers in `helpers` (multiaddrs) in turn to dial `ports` back.

    True: at least one port was reached; False: a peer tried and reached none; None: no peer answered.
    Each peer is asked in up to PROBE_ROUNDS rounds: the first stream to a peer includes setting up the
    connection, which over a slow or loaded link can take longer than `timeout_s`, and the next round reuses it
    (seen on a loaded 2-core machine: the only bootstrap peer answered nothing in time, and a public node could
    not tell that it is public). Only peers that never answer cost the time more than once.
    """
    for maddr in helpers * PROBE_ROUNDS:
        peer_id = PeerID.from_base58(Multiaddr(maddr)["p2p"])
        writer = None
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(peer_id, protocol_name(run_id)), timeout_s
            )
            await write_frame(writer, {"ports": ports})
            answer: Any = await read_frame(reader, _MAX_FRAME, 3 * timeout_s)
        except (TimeoutError, HandoffError, OSError, P2PDaemonError) as exc:  # e.g. handler unknown there
            logger.debug("dial-back probe via %s failed: %s", maddr, exc)
            continue
        finally:
            if writer is not None:
                close_writer(writer)
        if isinstance(answer, dict) and isinstance(answer.get("reachable"), list):
            return bool(answer["reachable"])
        logger.debug("dial-back probe via %s answered %r", maddr, answer)
    return None


def unreachable_message(ports: list[int], host_maddrs: list[str]) -> str:
    """The one message an operator sees when the node cannot be dialled."""
    port_text = ", ".join(f"TCP {p}" for p in ports) or "the listen port"
    return (
        f"this node cannot be dialled from the internet, so it joins as a DHT client (it still contributes "
        f"and hands off rollouts, but does not store records or serve others). To become a full peer, "
        f"forward {port_text} on your router or firewall to this machine, and if the port is random, fix it "
        f"with --host-maddrs /ip4/0.0.0.0/tcp/<port> (listening on {', '.join(host_maddrs)}); behind a "
        f"NAT also pass --announce-maddrs /ip4/<public ip>/tcp/<port>. See docs/swarm.md."
    )
