"""Who an advertised weights server may be: the node ids whose heartbeats name it, and the one it proved to be.

A heartbeat is signed by its node, but the weights URL in it is only that node's claim: any peer can name
another node's server (host, port and path) as its own, and a node that moved keeps naming its old address
until its next heartbeat, when another node may already serve there. So a peer source is a URL with a set of
claimants (`PeerClaims`), and the fetcher binds it to one of them only on the server's own word: the first
current availability record it serves that verifies under a claimant's node id (peering.py). The claimants it
did not prove to be gain nothing and are reported (`Disproved`): the node logs and counts them, and does not ban
them, since a stale heartbeat after an address change looks exactly like a false claim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .errors import FetchError

# Weights URL -> the node ids whose signed heartbeats name it (at least one).
PeerClaims = Mapping[str, frozenset[str]]


@dataclass(frozen=True)
class Disproved:
    """A server that several node ids named served a current record of `owner`: the `others` do not run it."""

    url: str
    owner: str
    others: frozenset[str]


def merge_claims(peers: PeerClaims, announced: set[str]) -> dict[str, frozenset[str]]:
    """The claims per URL as the fetcher uses it (no trailing slash), the claimant sets of URLs that differ only
    by that slash united; URLs the caller announced stay announced sources with no claimant (a peer naming
    "http://origin/" must not make the origin's records judged under its own id). FetchError for a URL with no
    claimant: a peer source is never taken on its word as an origin is."""
    merged: dict[str, frozenset[str]] = {}
    for url, claimants in peers.items():
        if not claimants:
            raise FetchError(f"peer source {url[:80]} has no claimant node id")
        key = url.rstrip("/")
        if key not in announced:
            merged[key] = merged.get(key, frozenset()) | frozenset(claimants)
    return merged
