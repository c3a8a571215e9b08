"""Peers serving weights: this node serves its verified checkpoints, and finds peers that serve theirs.

With `serve_weights` and a node that others can dial (the swarm's reachability check did not put it in
client mode) the node runs a p2p/weights server over its own checkpoint store and advertises in its heartbeat
which steps it serves (`serves_steps`) and where (`weights_url`). Before advertising, a bootstrap peer dials
the weights port back (p2p/swarm/reachability.py) on the address it sees the node at: a node that claims
reachability it does not have (`--reachability public`, or an announced address whose port is not forwarded)
would otherwise send every fetcher of the swarm to a dead address, each losing a connect timeout per fetch.
Unreached, it serves nobody and says what to forward. It serves only what verified, but not only whole
versions: while it fetches a step, each shard is served as soon as its SHA-256 matched the signed manifest
(p2p/weights/serve_verified.py), and the step is advertised as soon as its manifest verified. The server
signs with the node's key which shards it holds (p2p/weights/availability.py), so peers ask it only for
those, rarest first, and a node that claims a shard it then does not serve is demoted by every fetcher that
caught it. In the other direction, every node adds the peers that advertise a step as extra sources
when it fetches that step: they need no trust, as the fetcher still requires the operator-signed manifest
the announcement pins and checks every shard's hash (docs/weights.md).

What they cannot be trusted with is *where* the node connects. A heartbeat is signed by the peer, but every
field of it is the peer's own claim, its addresses included, so a peer could name any host as its weights
server and make every node of the swarm send requests there: to the node's own loopback services, to hosts
on its private network, or to a third party. So a URL from a heartbeat is used only when (`peer_url_refusal`):

  * its host is an IP address (a DNS name may resolve anywhere, and differently from one lookup to the next)
    that is one of the libp2p addresses in the same heartbeat;
  * that address is public (globally routable), or inside one of `peer_weights_networks`: loopback,
    private, link-local, shared (CGNAT), multicast and reserved ranges are refused unless the operator lists
    them (a devnet on one machine lists 127.0.0.0/8).

A source is a URL in one canonical spelling (`canonical_url`: host, port and path), with the set of node ids
whose signed heartbeats name it as its claimants. A peer that names an honest node's host on another port
becomes a source of its own (which answers nothing, or another node's records: charged to it), and never
displaces the honest node. A peer that names the honest node's very server only joins its claimants: the
fetcher binds the server to whichever claimant it proves to be, by the first current availability record it
serves that verifies under one of their ids (p2p/weights/peering.py), so the server stays in use, its records
are judged as its own node's, and the other claim gains nothing. The node logs such a claim with both ids and
counts it (`prime_node_contributor_weights_claims_disproved_total`), and does not ban on it: a node that moved
keeps naming its old address until its next heartbeat, while the node that now holds it serves there.
Many ports of one host count once when a fetch draws its peers (`sources_for`: hosts are drawn, then at most
MAX_URLS_PER_HOST servers of each), so a machine with many ids and ports cannot crowd the other hosts out
of a fetch; and within a host the servers a fetch found serving as a node that names them are drawn first
(`note_proven`), so ports named on an honest node's host by others cannot crowd its server out of its host's
share once this node has fetched from it. Before that, on a host naming more URLs than a fetch draws of it,
the node asks each unproven URL for its signed availability record, a few per host per minute
(source_proofs.py), each node naming it about a step of its own: the honest server proves its node id and is
drawn first from the next fetch on, and a URL where no node naming it served a current record of its step is
kept out of the draw for a while.

What is left is a peer naming a public host that is not its own, with one request per node per fetch to a
path of /v1/weights/; any source's answers are then bounded and verified like every other's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
from urllib.parse import urlsplit

from ...p2p.identity import Identity
from ...p2p.swarm import Heartbeat, Swarm
from ...p2p.urls import routable_url
from ...p2p.weights.http_head import check_source_url
from ...p2p.weights.serve_verified import ServeAsVerified
from ...p2p.weights.server import WeightsServer
from ...p2p.weights.store import Store
from .settings import StartSettings
from .source_proofs import ProofSettings, ProofTarget, SourceProver
from .state import NodeState

logger = logging.getLogger(__name__)

# Per fetch, drawn at random: load spreads over the peers that serve a step, and each fetch has enough peers to
# trade with (benchmarks/broadcast.py measures the swarm with this many). Hosts are drawn, not servers: a host
# counts once however many ports its peers name, and gives at most MAX_URLS_PER_HOST of them.
MAX_PEER_SOURCES = 8
MAX_URLS_PER_HOST = 3
# Servers found serving as a node that names them, remembered to be drawn first (a bound on a long life's memory).
MAX_PROVEN_KEPT = 4096


class WeightsSharing:
    def __init__(
        self,
        store: Store,
        settings: StartSettings,
        operator_key: str,
        swarm: Swarm,
        state: NodeState,
        identity: Identity | None = None,
        proofs: ProofSettings | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.operator_key = operator_key
        self.swarm = swarm
        self.state = state
        self.identity = identity  # signs the server's availability records
        self.server: WeightsServer | None = None
        # step -> {weights URL: the node ids naming it} of live, unbanned peers
        self._peer_urls: dict[int, dict[str, frozenset[str]]] = {}
        # weights URL -> {node id naming it: the steps that node says it serves there}: each claimant's own
        # claims, for the dial-back proofs (`proof_targets`), which must never ask a URL about a step that only
        # some other claimant named
        self._claims: dict[str, dict[str, frozenset[int]]] = {}
        self.networks = [ipaddress.ip_network(n, strict=False) for n in settings.peer_weights_networks]
        self.refused: dict[str, str] = {}  # node id -> why its weights URL is not used (status, tests)
        self.contested: dict[str, frozenset[str]] = {}  # weights URL -> the node ids naming it, when several
        self._proven: dict[
            str, str
        ] = {}  # weights URL -> the node a fetch found serving there (`note_proven`)
        # Dial-back proofs on hosts naming more URLs than a fetch draws of one (`proof_targets`).
        self.prover = SourceProver(self.note_proven, identity, proofs, slots_per_host=MAX_URLS_PER_HOST)

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
            self.store,
            self.settings.serve,
            self.operator_key,
            metrics=self.state.metrics.weights,
            identity=self.identity,
        )
        bound = await server.start()
        url = self.settings.weights_public_url or routable_url(bound, await self.swarm.maddrs())
        if url is None:
            await server.stop()
            logger.warning(
                "not serving weights: %s is not an address peers can use; set weights_public_url", bound
            )
            return False
        if not await self._dialled_back(url):
            await server.stop()
            return False
        server.accept_audience(url)  # peers address the advertised URL, which may differ from the bound one
        self.server = server
        self.swarm.weights_url = self.state.serving_weights = url
        logger.info("serving verified checkpoints to peers at %s", url)
        return True

    def serve_as_verified(self) -> ServeAsVerified | None:
        """Hooks that serve each shard of a fetch once it verified (None when this node does not serve)."""
        return ServeAsVerified(self.server) if self.server is not None else None

    async def _dialled_back(self, url: str) -> bool:
        """Whether a bootstrap peer reached the URL's port (True also when none could test it: as the DHT's
        own self-test, the node then trusts its configuration and says so)."""
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        reached = await self.swarm.dial_back([port])
        if reached is None:
            logger.warning(
                "could not test whether peers can reach the weights server at %s (no bootstrap peer answered "
                "the dial-back probe); advertising it",
                url,
            )
            return True
        if not reached:
            logger.warning(
                "not serving weights: a peer could not connect to TCP %d on this node's public address, so %s "
                "is not advertised. Forward TCP %d on your router or firewall to this machine (or set "
                "weights_public_url to an address that reaches it); see docs/swarm.md.",
                port,
                url,
                port,
            )
        return reached

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    def tasks(self) -> list[asyncio.Task[None]]:
        """The weights server's own background tasks (its rescans), for the node's supervisor."""
        scanner = self.server.scanner if self.server is not None else None
        return [scanner] if scanner is not None else []

    async def advertise(self) -> None:
        """Supervised task: keep the heartbeat's `serves_steps` equal to what the server serves, a version being
        fetched included once its manifest verified (its availability record says which shards it holds)."""
        assert self.server is not None
        while True:
            served = sorted(self.server.versions)
            self.swarm.serves_steps = served
            await asyncio.sleep(self.settings.serve.scan_interval_s)

    def note_peers(self, peers: dict[str, Heartbeat], banned: set[str]) -> None:
        """Remember which live peers serve which steps (called after each peer scan).

        A source is a URL in canonical form (`canonical_url`: the server, host and port, and the path), and its
        claimants are every node id whose heartbeat names it: a peer naming an honest node's host on another port
        is a source of its own and displaces nobody, and one naming the honest node's very server only joins its
        claimants. The fetcher binds such a contested server to the claimant whose current signed availability
        record it serves (p2p/weights/peering.py), so the server stays in use and the false (or stale) claim
        gains nothing. A URL is a source for a step when any of its claimants says it serves that step."""
        claims: dict[str, dict[str, frozenset[int]]] = {}
        refused: dict[str, str] = {}
        for node_id, heartbeat in sorted(peers.items()):
            url = heartbeat.weights_url
            if node_id == self.swarm.node_id or node_id in banned or heartbeat.client_mode or not url:
                continue
            why = peer_url_refusal(url, list(heartbeat.addresses), self.networks)
            if why is not None:
                refused[node_id] = why
                continue
            claims.setdefault(canonical_url(url), {})[node_id] = frozenset(heartbeat.serves_steps)
        by_step: dict[int, dict[str, frozenset[str]]] = {}
        contested: dict[str, frozenset[str]] = {}
        for url, named in claims.items():
            claimants = frozenset(named)
            if len(claimants) > 1:
                contested[url] = claimants
            for step in set[int]().union(*named.values()):
                by_step.setdefault(step, {})[url] = claimants
        for node_id, why in refused.items():
            if self.refused.get(node_id) != why:
                logger.info("not fetching from peer %s…: %s", node_id[:16], why)
        for url, claimants in contested.items():
            if self.contested.get(url) != claimants:
                logger.info(
                    "peers %s all name %s as their weights server; a fetch uses it as the one whose signed "
                    "records it serves",
                    ", ".join(f"{n[:16]}…" for n in sorted(claimants)),
                    url,
                )
        self._peer_urls = by_step
        self._claims = claims
        self.refused = refused
        self.contested = contested
        self.prover.wake()

    async def prove_sources(self) -> None:
        """Supervised task: dial-back proofs of the URLs on contested hosts (source_proofs.py)."""
        await self.prover.run(self.proof_targets)

    def proof_targets(self) -> tuple[list[ProofTarget], set[str], set[str]]:
        """Every peer URL with its claimants and the steps to ask it about, the URLs already proven to be served
        by a node that still names them, and the hosts where a URL was ever proven (asked first).

        Each claimant is asked about its own newest step, never a step only another claimant named: a sybil
        naming an honest node's URL with steps that server does not serve must not get it held out. Steps
        beyond the announced one (which no fetch draws sources for yet, and a heartbeat bounds no step) are
        asked only of a claimant naming no other, after the rest, nearest first: an honest node may have
        fetched a step this node has not seen announced yet."""
        announced = self.state.announced_step
        targets: list[ProofTarget] = []
        for url, named in self._claims.items():
            asked: set[int] = set()
            for steps in named.values():
                within = [s for s in steps if announced is None or s <= announced]
                if within or steps:
                    asked.add(max(within or steps))
            ordered = sorted((s for s in asked if announced is None or s <= announced), reverse=True)
            ordered += sorted(s for s in asked if announced is not None and s > announced)
            urgent = announced is not None and announced in asked
            targets.append(ProofTarget(url, frozenset(named), tuple(ordered), urgent))
        proven = {t.url for t in targets if self._proven.get(t.url, "") in t.claimants}
        return targets, proven, {_host(url) for url in self._proven}

    def note_proven(self, url: str, node_id: str) -> None:
        """A fetch found `node_id` serving at `url`: it served a current availability record signed by that
        node, which named the URL, and told no lie (p2p/weights/fetch.py `Fetcher.proven`)."""
        self._proven.pop(url, None)  # the newest last: the oldest is forgotten first
        self._proven[url] = node_id
        if len(self._proven) > MAX_PROVEN_KEPT:
            del self._proven[next(iter(self._proven))]

    def sources_for(self, step: int) -> dict[str, frozenset[str]]:
        """Peers serving `step`: up to MAX_PEER_SOURCES hosts drawn at random, and up to MAX_URLS_PER_HOST of
        each one's servers: {weights URL: the node ids one of which must sign its availability records} (the
        fetcher uses a peer only on a current record of one of them).

        Within a host, servers already found serving as a node that still names them (`note_proven`) are drawn
        first, for all slots but one; the rest are drawn at random. A peer that names many ports or paths on an
        honest node's host (listing its address as its own) cannot push the honest server out of the draw once
        this node has fetched from it, or proved it by a dial-back (source_proofs.py): the false servers can never
        be proven, as nothing there signs as their claimants. The one random slot keeps a newcomer on a host of
        proven servers (several nodes behind one NAT) in the draw. A URL whose dial-back failed is not drawn
        while it is held out."""
        peers = self._peer_urls.get(step, {})
        by_host: dict[str, list[str]] = {}
        for url in sorted(peers):
            by_host.setdefault(_host(url), []).append(url)
        drawn: list[str] = []
        for host in random.sample(sorted(by_host), min(MAX_PEER_SOURCES, len(by_host))):
            urls = by_host[host]
            proven = [u for u in urls if self._proven.get(u, "") in peers[u]]  # still named by that node
            first = random.sample(proven, min(MAX_URLS_PER_HOST - 1, len(proven)))
            rest = [u for u in urls if u not in first and not self.prover.held_out(u)]
            drawn += first + random.sample(rest, min(MAX_URLS_PER_HOST - len(first), len(rest)))
        return {url: peers[url] for url in drawn}


def _host(url: str) -> str:
    return urlsplit(url).hostname or ""


def canonical_url(url: str) -> str:
    """The one spelling of an IP-host URL that the fetcher uses: scheme, `server_of`, and the path without a
    trailing slash, so claims that differ only in how they spell the same URL are claims on one source."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{server_of(url)}{parts.path.rstrip('/')}"


def server_of(url: str) -> str:
    """The server an IP-host URL names, host and port (the scheme's default when none is given), one spelling
    of each: URLs that differ in how they spell the address or the port reach the same server."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    ip = ipaddress.ip_address(parts.hostname or "")  # peer_url_refusal admitted only IP hosts
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def peer_url_refusal(
    url: str, maddrs: list[str], networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network]
) -> str | None:
    """Why a weights URL from a peer's heartbeat must not be fetched from (None: it may be); see the module
    docstring. `maddrs` are the heartbeat's own libp2p addresses, `networks` the ones allowed beyond public."""
    why = check_source_url(url)
    if why is not None:
        return why
    host = _host(url)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"its host {host[:60]!r} is a name, not an IP address"
    own = {m.split("/")[2] for m in maddrs if m.startswith(("/ip4/", "/ip6/")) and m.count("/") >= 2}
    if not any(_same_ip(ip, text) for text in own):
        return f"{ip} is not one of the peer's own addresses"
    if not ip.is_global and not any(ip in network for network in networks):
        return f"{ip} is not a public address (list its network in peer_weights_networks to allow it)"
    return None


def _same_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, text: str) -> bool:
    try:
        return ipaddress.ip_address(text) == ip
    except ValueError:
        return False
