"""Serving a version while it is fetched: its manifest once verified, each shard as soon as it verified.

Relays (relay.py) and contributor nodes that re-serve weights (node/contributor/serving.py) fetch a version
exactly as any client does and hand it on through their own weights server. Waiting for the whole checkpoint
before serving any of it would make every hop a store-and-forward; here a shard is offered the moment its
SHA-256 matched the signed manifest, and never before, so a tree of relays or a swarm of peers is pipelined
and nothing unverified is ever served. A fetch that fails withdraws the version; verified shards stay on
disk for the next try. A fetch that ends holding only part of the version (a pipeline stage's shards,
selection.py) leaves it advertised as it is: its availability record lists the shards held, and any other is
refused (503), never served from the sparse files' unwritten bytes.
"""

from __future__ import annotations

from .manifest import SignedManifest
from .result import FetchResult
from .server import WeightsServer


class ServeAsVerified:
    """Hooks for one fetcher at a time (`on_manifest`, `on_shard`), then `finished` or `abandoned`."""

    def __init__(self, server: WeightsServer) -> None:
        self.server = server
        self.step: int | None = None  # the version being fetched, once its manifest verified

    def on_manifest(self, manifest: SignedManifest, _resumed: int) -> None:
        self.step = manifest.step
        self.server.add_partial(manifest, self.server.store.checkpoint_dir(manifest.step, partial=True))

    def on_shard(self, index: int) -> None:
        if self.step is not None:
            self.server.shard_ready(self.step, index)

    def finished(self, result: FetchResult) -> None:
        if result.complete:
            self.server.mark_complete(result.manifest, result.checkpoint_dir)
        self.step = None

    def offer_held(self, manifest: SignedManifest, shards: frozenset[int]) -> None:
        """Serve the verified shards of a version held in part from an earlier run (none is being fetched)."""
        self.server.add_partial(manifest, self.server.store.checkpoint_dir(manifest.step, partial=True))
        for index in sorted(shards):
            self.server.shard_ready(manifest.step, index)

    def withdraw(self, step: int) -> None:
        """Stop serving a version held in part (its files are being deleted)."""
        self.server.drop(step)

    def abandoned(self) -> None:
        if self.step is not None:
            self.server.drop(self.step)
        self.step = None
