"""A relay: follow upstream servers, mirror each new version, and serve it while it arrives.

The relay fetches exactly as a client does (fetch.py): the manifest is verified against the pinned key
before it is advertised, and each shard is advertised only once its own SHA-256 verified. A version that
fails verification is dropped and never listed as complete; a bad shard is never served.
"""

from __future__ import annotations

import asyncio
import logging

from ..identity import Identity
from .errors import WeightsError
from .fetch import Fetcher, FetchSettings
from .serve_verified import ServeAsVerified
from .server import WeightsServer

logger = logging.getLogger(__name__)


class Relay:
    """Mirrors versions from `upstreams` into `server`'s store and serves them through `server`."""

    def __init__(
        self,
        server: WeightsServer,
        upstreams: list[str],
        trusted_key: str,
        fetch_settings: FetchSettings | None = None,
        *,
        poll_interval_s: float = 2.0,
        identity: Identity | None = None,
    ) -> None:
        self.server = server
        self.poll_interval_s = poll_interval_s
        self.fetcher = Fetcher(upstreams, trusted_key, server.store, fetch_settings, identity=identity)
        self.serving = ServeAsVerified(server)
        self.fetcher.on_manifest = self.serving.on_manifest
        self.fetcher.on_shard = self.serving.on_shard
        self.failures: list[str] = []  # recent reasons a version was not mirrored (status, tests)

    async def run(self) -> None:
        """Follow the upstreams until cancelled; one failed round is logged, never fatal."""
        while True:
            try:
                await self.follow_once()
            except WeightsError as exc:
                self.failures = (self.failures + [str(exc)])[-10:]
                logger.warning("relay: %s", exc)
            await asyncio.sleep(self.poll_interval_s)

    async def follow_once(self) -> int | None:
        """Mirror the upstreams' newest version if it is newer than what is held; returns its step."""
        try:
            resolution = await self.fetcher.resolve(None)
            manifest = resolution.manifest
            if manifest.step <= self.server.store.high_water():
                return None
            try:
                result = await self.fetcher.fetch_version(resolution)
            except BaseException:
                self.serving.abandoned()
                raise
        finally:
            self.fetcher.close()
        self.serving.finished(result)
        await self.server.rescan()
        logger.info("relay: mirrored step %d", manifest.step)
        return manifest.step
