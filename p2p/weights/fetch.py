"""Verified multi-source fetch of one checkpoint version into a store.

Order of trust: manifests are fetched from every source (size-bounded) and verified against the pinned
key before any shard is requested; a step older than one already held is refused. Shards are then drawn
from the sources that serve the chosen manifest (sources.py), each verified on arrival (transfer.py,
scheduled by shardrun.py); a bad shard is discarded, its source penalised and the shard fetched
elsewhere. Progress is journaled so a rerun resumes with Range requests, and only a version whose every
shard verified is moved into place.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from ..identity import Identity
from .access import TokenSource
from .errors import FetchError, ManifestError, StoreError
from .manifest import MAX_MANIFEST_BYTES, SignedManifest, parse_signed
from .sources import SelectionSettings, SourcePool
from .shardrun import FetchResult, ShardRun
from .store import Store
from .transfer import ConnectionPool, fetch_document

logger = logging.getLogger(__name__)


class FetchSettings(BaseModel):
    """Timeouts, parallelism and retry bounds of a fetch."""

    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(8, ge=1, le=256, description="Shards downloaded at once (over all sources).")
    connect_timeout_s: float = Field(5.0, gt=0, description="Time allowed to open a connection to a source.")
    stall_timeout_s: float = Field(15.0, gt=0, description="A source that sends no byte for this long has stalled.")
    manifest_timeout_s: float = Field(15.0, gt=0, description="Total time allowed for one manifest request.")
    max_attempts_per_shard: int = Field(8, ge=1, le=1000, description="Attempts (over all sources) before giving up.")
    max_not_ready: int = Field(1000, ge=0, description="'Not verified yet' (503) answers from relays tolerated per shard.")
    chunk_bytes: int = Field(1 << 20, ge=4096, description="Bytes per socket read; also the resume granularity.")
    save_interval_s: float = Field(1.0, gt=0, description="How often resume progress is journaled to disk.")
    durable: bool = Field(True, description="fsync the checkpoint before moving it into place.")
    keep: int = Field(0, ge=0, description="After success keep only this many versions (0: keep all).")
    selection: SelectionSettings = Field(default_factory=SelectionSettings, description="Source scoring.")


def manifest_path(step: int | None) -> str:
    return "/v1/weights/latest" if step is None else f"/v1/weights/{step}/manifest"


class Fetcher:
    """Fetches checkpoint versions signed by `trusted_key` from `sources` into `store`."""

    def __init__(
        self,
        sources: list[str],
        trusted_key: str,
        store: Store,
        settings: FetchSettings | None = None,
        *,
        identity: Identity | None = None,
        on_bytes: Callable[[int], None] | None = None,
        on_shard: Callable[[int], None] | None = None,
    ) -> None:
        if not sources:
            raise FetchError("no sources given; pass at least one --source URL")
        self.sources = list(dict.fromkeys(s.rstrip("/") for s in sources))
        self.trusted_key = trusted_key
        self.store = store
        self.settings = settings or FetchSettings()
        # With an identity every request carries a signed access token, so servers can refuse banned nodes.
        self.connections = ConnectionPool(
            self.settings.connect_timeout_s, self.settings.stall_timeout_s,
            TokenSource(identity) if identity is not None else None,
        )
        self.on_bytes = on_bytes  # called on the event loop with each chunk's size (progress bars)
        self.on_shard = on_shard  # called with each shard index once it verified (relays advertise it)
        self.on_manifest: Callable[[SignedManifest, int], None] | None = None  # (manifest, bytes resumed)

    async def fetch(self, step: int | None = None) -> FetchResult:
        """Fetch `step` (or the newest step any source serves) and return where it now lies, verified."""
        try:
            manifest, serving, errors = await self.resolve(step)
            return await self.fetch_version(manifest, serving, errors)
        finally:
            self.connections.close()

    async def _get_manifest(self, source: str, step: int | None) -> SignedManifest:
        s = self.settings
        raw = await asyncio.to_thread(
            fetch_document, self.connections, source, manifest_path(step), MAX_MANIFEST_BYTES, s.manifest_timeout_s
        )
        manifest = await asyncio.to_thread(parse_signed, raw, self.trusted_key)
        if step is not None and manifest.step != step:
            raise ManifestError(f"answered a manifest for step {manifest.step} when asked for step {step}")
        return manifest

    async def _gather_manifests(self, sources: list[str], step: int | None) -> tuple[dict[str, SignedManifest], dict[str, str]]:
        results = await asyncio.gather(*(self._get_manifest(s, step) for s in sources), return_exceptions=True)
        found: dict[str, SignedManifest] = {}
        errors: dict[str, str] = {}
        for source, result in zip(sources, results):
            if isinstance(result, ManifestError):
                errors[source] = str(result)
                logger.warning("source %s: %s", source, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                found[source] = result
        return found, errors

    async def resolve(self, step: int | None) -> tuple[SignedManifest, list[str], dict[str, str]]:
        """Choose the manifest to fetch; returns it, the sources serving it and why the others are unused."""
        found, errors = await self._gather_manifests(self.sources, step)
        if not found:
            detail = "; ".join(f"{s}: {e}" for s, e in errors.items())
            raise FetchError(f"no source served a valid manifest signed by {self.trusted_key[:16]}…: {detail}",
                             [{"shard": None, "source": s, "reason": e, "corrupt": False} for s, e in errors.items()])
        best_step = max(m.step for m in found.values())
        votes = collections.Counter(m.digest for m in found.values() if m.step == best_step)
        digest = votes.most_common(1)[0][0]
        if len(votes) > 1:
            logger.warning("sources disagree on step %d (%d different signed manifests); using %s", best_step,
                           len(votes), digest[:16])
        chosen = next(m for m in found.values() if m.digest == digest)
        serving = [s for s, m in found.items() if m.digest == digest]
        laggards = [s for s, m in found.items() if m.digest != digest]
        if laggards and step is None:  # a source whose newest is older may still hold the chosen version
            again, _ = await self._gather_manifests(laggards, best_step)
            serving += [s for s, m in again.items() if m.digest == digest]
        for source in laggards:
            if source not in serving:
                errors[source] = f"serves step {found[source].step}, not manifest {digest[:16]}… of step {best_step}"
        return chosen, serving, errors

    async def fetch_version(self, manifest: SignedManifest, serving: list[str], errors: dict[str, str] | None = None) -> FetchResult:
        """Fetch the shards of a verified manifest from `serving` and move the version into place."""
        self.store.check_not_replayed(manifest)
        held = self.store.version_dir(manifest.step)
        if held.exists():
            stored = await asyncio.to_thread(self.store.load_manifest, manifest.step, self.trusted_key)
            if stored.digest != manifest.digest:
                raise StoreError(f"{held} holds another manifest for step {manifest.step} than the sources serve")
            return FetchResult(manifest=manifest, version_dir=held, already_held=True)
        pool = SourcePool(self.sources, self.settings.selection)
        for source in self.sources:
            if source not in serving:
                pool.exclude(source, (errors or {}).get(source, "does not serve this manifest"))
        partial = await asyncio.to_thread(self.store.open_partial, manifest)
        return await ShardRun(self, partial, pool).execute()
