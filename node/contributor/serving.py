"""Peers serving weights: this node serves its verified checkpoints, and finds peers that serve theirs.

With `serve_weights` and a node that others can dial (the swarm's reachability check did not put it in
client mode) the node runs a p2p/weights server over its own checkpoint store, so it only ever serves
versions that verified, and advertises in its heartbeat which steps it serves (`serves_steps`) and where
(`weights_url`). In the other direction, every node adds the peers that advertise a step as extra sources
when it fetches that step: they need no trust, as the fetcher still requires the operator-signed manifest
the announcement pins and checks every shard's hash (docs/weights.md). A peer's URL is used only when its
host is one of the IP addresses of the same heartbeat, so a peer cannot point the swarm at a third party.
"""

from __future__ import annotations

import asyncio
import logging
import random
from urllib.parse import urlsplit

from ...p2p.swarm import Heartbeat, Swarm
from ...p2p.urls import routable_url
from ...p2p.weights.server import WeightsServer
from ...p2p.weights.store import Store
from .settings import StartSettings
from .state import NodeState

logger = logging.getLogger(__name__)

MAX_PEER_SOURCES = 4  # per fetch, drawn at random: load spreads over the peers that serve a step


class WeightsSharing:
    def __init__(
        self, store: Store, settings: StartSettings, operator_key: str, swarm: Swarm, state: NodeState
    ) -> None:
        self.store = store
        self.settings = settings
        self.operator_key = operator_key
        self.swarm = swarm
        self.state = state
        self.server: WeightsServer | None = None
        self._peer_urls: dict[int, list[str]] = {}  # step -> weights URLs of live, unbanned peers

    async def start(self) -> bool:
        """Start serving when asked to and reachable; False (with the reason logged) otherwise."""
        if not self.settings.serve_weights:
            return False
        if self.swarm.client_mode:
            logger.warning(
                "not serving weights: peers cannot dial this node (it runs as a DHT client; see docs/swarm.md)"
            )
            return False
        server = WeightsServer(
            self.store, self.settings.serve, self.operator_key, metrics=self.state.metrics.weights
        )
        bound = await server.start()
        url = self.settings.weights_public_url or routable_url(bound, await self.swarm.maddrs())
        if url is None:
            await server.stop()
            logger.warning(
                "not serving weights: %s is not an address peers can use; set weights_public_url", bound
            )
            return False
        server.accept_audience(url)  # peers address the advertised URL, which may differ from the bound one
        self.server = server
        self.swarm.weights_url = self.state.serving_weights = url
        logger.info("serving verified checkpoints to peers at %s", url)
        return True

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    def tasks(self) -> list[asyncio.Task[None]]:
        """The weights server's own background tasks (its rescans), for the node's supervisor."""
        scanner = self.server.scanner if self.server is not None else None
        return [scanner] if scanner is not None else []

    async def advertise(self) -> None:
        """Supervised task: keep the heartbeat's `serves_steps` equal to what the server serves."""
        assert self.server is not None
        while True:
            served = sorted(step for step, version in self.server.versions.items() if version.complete)
            self.swarm.serves_steps = served
            await asyncio.sleep(self.settings.serve.scan_interval_s)

    def note_peers(self, peers: dict[str, Heartbeat], banned: set[str]) -> None:
        """Remember which live peers serve which steps (called after each peer scan)."""
        by_step: dict[int, list[str]] = {}
        for node_id, heartbeat in peers.items():
            if (
                node_id == self.swarm.node_id
                or node_id in banned
                or heartbeat.client_mode
                or not heartbeat.weights_url
            ):
                continue
            if not _same_host(heartbeat.weights_url, list(heartbeat.addresses)):
                continue  # a URL elsewhere than the peer itself would turn nodes into someone else's clients
            for step in heartbeat.serves_steps:
                by_step.setdefault(step, []).append(heartbeat.weights_url)
        self._peer_urls = by_step

    def sources_for(self, step: int) -> list[str]:
        urls = self._peer_urls.get(step, [])
        return random.sample(urls, min(MAX_PEER_SOURCES, len(urls)))


def _same_host(url: str, maddrs: list[str]) -> bool:
    """Whether `url`'s host is one of the IP addresses of `maddrs` (the peer's own libp2p addresses)."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    return host is not None and any(
        m.split("/")[2:3] == [host] for m in maddrs if m.startswith(("/ip4/", "/ip6/"))
    )
