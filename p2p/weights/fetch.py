"""Verified multi-source fetch of one checkpoint version into a store.

Order of trust: manifests are asked of every source at once (size-bounded, each under a wall-clock deadline)
and verified against the pinned key before any shard is requested; a step older than one already held is
refused. The fetch does not wait for the slowest source: once a valid manifest is in hand (the pinned one,
when the caller pins a digest) and `manifest_grace_s` has passed, it chooses and starts; a source whose
manifest arrives later joins if it serves the chosen one. Shards are then drawn from the sources that serve
it (sources.py), scheduled and hedged by shardrun.py, each verified on arrival (transfer.py); a bad shard is
discarded, its source penalised and the shard fetched elsewhere. A source's failure, whatever it sent, is
charged to that source and never ends a fetch that another source can still serve; only our own failures
(the disk, a bug) propagate. Progress is journaled so a rerun resumes with Range requests (from the source
that sent the bytes on disk, attempts.py), and only a version whose every shard verified is moved into place.

Peers the swarm advertised (`peers`: URL -> the node ids whose signed heartbeats name it, claims.py) are
sources with less standing than the ones the caller names: each is asked for a shard only once a current
availability record signed by one of those node ids verified and claims it, the first such record binding
the URL to that node for the fetch (peering.py; the other claimants are reported in `disproved`), and one
that sends bytes not matching the manifest is dropped from the fetch and charged (outcomes.py).

With a selection plan (selection.py) only the shards it names are fetched, in rounds (a stage's plan reads the
safetensors headers from their verified shards before it names the tensors' shards), and a version held in part
stays under the store's .partial/; a later, wider fetch of it downloads only what is missing.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..identity import Identity
from .access import TokenSource
from .claims import Disproved, PeerClaims, merge_claims
from .connections import ConnectionPool
from .errors import FetchError, ManifestAbsent, ManifestError, StoreError
from .fetch_settings import FetchSettings
from .http_head import check_source_url
from .manifest import MAX_MANIFEST_BYTES, SignedManifest, parse_signed
from .result import FetchResult
from .run_state import FetchContext
from .selection import MAX_PLAN_ROUNDS, Selection, SelectionPlan
from .shardrun import ShardRun
from .sources import SourcePool
from .store import Store
from .transfer import fetch_document

logger = logging.getLogger(__name__)


def manifest_path(step: int | None) -> str:
    return "/v1/weights/latest" if step is None else f"/v1/weights/{step}/manifest"


@dataclass
class Resolution:
    """The manifest chosen for a fetch, who serves it, why the others are not used, and who may still join."""

    manifest: SignedManifest
    serving: list[str]
    errors: dict[str, str] = field(default_factory=dict)
    # Sources whose manifest had not arrived when the fetch chose: each joins if its manifest is this one.
    pending: dict[str, asyncio.Task[SignedManifest]] = field(default_factory=dict)
    # Sources that did not hold the version (404/503): asked again while the shards are fetched (peering.py).
    absent: set[str] = field(default_factory=set)


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
        peers: PeerClaims | None = None,
    ) -> None:
        if not sources:
            raise FetchError("no sources given; pass at least one --source URL")
        given = dict(peers or {})
        # Advertised peers among the sources: URL -> the node ids one of which must sign their availability
        # records. URLs are compared as the fetcher uses them (no trailing slash): a peer naming an announced
        # source's URL ("http://origin/" for "http://origin") must not make it a peer source.
        announced = {s.rstrip("/") for s in sources if s not in given}
        self.sources = list(dict.fromkeys(s.rstrip("/") for s in sources))
        self.peers = merge_claims(given, announced)
        unknown = set(self.peers) - set(self.sources)
        if unknown:
            raise FetchError(f"peers {sorted(unknown)[:3]} are not among the sources")
        # A URL that cannot be a source (a bad port, a non-ASCII host) is refused here, before any connection.
        self.invalid = {
            s: f"not usable as a source: {why}" for s in self.sources if (why := check_source_url(s))
        }
        self.trusted_key = trusted_key
        self.store = store
        self.settings = settings or FetchSettings()
        # With an identity every request carries a signed access token, so servers can refuse banned nodes.
        self.connections = ConnectionPool(
            self.settings.connect_timeout_s,
            self.settings.stall_timeout_s,
            TokenSource(identity) if identity is not None else None,
        )
        self.on_bytes = on_bytes  # called on the event loop with each chunk's size (progress bars)
        self.on_shard = on_shard  # called with each shard index once it verified (relays advertise it)
        self.on_manifest: Callable[[SignedManifest, int], None] | None = None  # (manifest, bytes resumed)
        self._manifest_tasks: set[asyncio.Task[SignedManifest]] = set()
        # Manifest requests get threads of their own: sources that stall must not queue behind each other (or
        # behind anything else in the loop's default executor) while an honest one waits its turn.
        self._manifest_threads: ThreadPoolExecutor | None = None
        self._verified: dict[bytes, SignedManifest] = {}  # SHA-256 of a manifest's bytes -> it, verified
        # Advertised peers this fetcher dropped for sending wrong bytes (node id -> why), success or not: the
        # caller can leave them out of its next fetches (pinned.py does).
        self.dropped_peers: dict[str, str] = {}
        # Contested peer URLs that proved to be one claimant's: the others' claims, for the caller to report.
        self.disproved: list[Disproved] = []
        # Peer URLs that served a current record signed by the node bound to them, and told no lie (URL -> that
        # node id): whoever chooses peer sources may prefer them (node/contributor/serving.py).
        self.proven: dict[str, str] = {}

    async def fetch(self, step: int | None = None) -> FetchResult:
        """Fetch `step` (or the newest step any source serves) and return where it now lies, verified."""
        try:
            return await self.fetch_version(await self.resolve(step))
        finally:
            self.close()

    def close(self) -> None:
        """Cancel manifest requests still running, cut every request in flight, close idle connections."""
        for task in self._manifest_tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a late source's failure is no longer anyone's concern
            task.cancel()
        self._manifest_tasks.clear()
        self.connections.abort()
        self.connections.close()
        if self._manifest_threads is not None:
            self._manifest_threads.shutdown(wait=False)  # each is cut by the abort above and ends at once
            self._manifest_threads = None

    def _spawn_manifest(self, source: str, step: int | None) -> asyncio.Task[SignedManifest]:
        if self._manifest_threads is None:
            self._manifest_threads = ThreadPoolExecutor(
                max_workers=min(64, len(self.sources) * 2), thread_name_prefix="weights-manifest"
            )
        task = asyncio.create_task(self._get_manifest(source, step), name="weights-manifest")
        self._manifest_tasks.add(task)
        return task

    async def _get_manifest(self, source: str, step: int | None) -> SignedManifest:
        s, loop = self.settings, asyncio.get_running_loop()
        raw = await loop.run_in_executor(
            self._manifest_threads,
            fetch_document,
            self.connections,
            source,
            manifest_path(step),
            MAX_MANIFEST_BYTES,
            s.manifest_timeout_s,
        )
        manifest = await loop.run_in_executor(self._manifest_threads, self._verify_manifest, raw)
        if step is not None and manifest.step != step:
            raise ManifestError(f"answered a manifest for step {manifest.step} when asked for step {step}")
        return manifest

    def _verify_manifest(self, raw: bytes) -> SignedManifest:
        """`raw` parsed and verified against the pinned key, once per distinct document: sources that serve
        the same bytes (every honest relay and peer, and any source copying them) cost one verification,
        not one each, while the fetch runs. A failure is not remembered: it is raised for each source."""
        key = hashlib.sha256(raw).digest()
        known = self._verified.get(key)
        if known is None:
            known = self._verified[key] = parse_signed(raw, self.trusted_key)
        return known

    async def resolve(self, step: int | None = None, *, digest: str | None = None) -> Resolution:
        """Choose the manifest to fetch (of `step`, or the newest; the one whose id is `digest` when given).

        Returns as soon as the pinned manifest is in hand, or `manifest_grace_s` after the first valid one,
        or when every source answered: a slow or silent source delays nobody. Sources still answering are
        returned as pending; they join the fetch if they turn out to serve the chosen manifest."""
        loop = asyncio.get_running_loop()
        errors = dict(self.invalid)
        pending = {src: self._spawn_manifest(src, step) for src in self.sources if src not in errors}
        found: dict[str, SignedManifest] = {}
        absent: set[str] = set()
        first_at: float | None = None
        while pending:
            if digest is not None and any(m.digest == digest for m in found.values()):
                break  # the pinned manifest: nothing any other source says can change the choice
            timeout = None
            if first_at is not None and digest is None:
                timeout = first_at + self.settings.manifest_grace_s - loop.time()
            if timeout is not None and timeout <= 0:
                break
            done, _ = await asyncio.wait(
                pending.values(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            for source in [src for src, task in pending.items() if task in done]:
                try:
                    found[source] = pending.pop(source).result()
                except ManifestError as exc:  # anything else is not the source's doing: it propagates
                    errors[source] = str(exc)
                    if isinstance(exc, ManifestAbsent):
                        absent.add(source)  # e.g. a peer still fetching it: not a fault
                        logger.info("source %s: %s", source, exc)
                    else:
                        logger.warning("source %s: %s", source, exc)
            if found and first_at is None:
                first_at = loop.time()
        if not found:
            detail = "; ".join(f"{s}: {e}" for s, e in errors.items())
            raise FetchError(
                f"no source served a valid manifest signed by {self.trusted_key[:16]}…: {detail}",
                [{"shard": None, "source": s, "reason": e, "corrupt": False} for s, e in errors.items()],
            )
        chosen = self._choose(found, digest, errors)
        serving = [s for s, m in found.items() if m.digest == chosen.digest]
        for source, manifest in found.items():
            if manifest.digest == chosen.digest:
                continue
            if step is None and digest is None and manifest.step < chosen.step:
                # A source whose newest is older may still hold the chosen version: asked for it, it may join.
                pending[source] = self._spawn_manifest(source, chosen.step)
                errors[source] = (
                    f"serves step {manifest.step}, not manifest {chosen.digest[:16]}… of step {chosen.step}"
                )
            else:
                errors[source] = (
                    f"serves manifest {manifest.digest[:16]}… of step {manifest.step}, not "
                    f"{chosen.digest[:16]}… of step {chosen.step}"
                )
        return Resolution(chosen, serving, errors, pending, absent)

    def _choose(
        self, found: dict[str, SignedManifest], digest: str | None, errors: dict[str, str]
    ) -> SignedManifest:
        if digest is not None:
            pinned = next((m for m in found.values() if m.digest == digest), None)
            if pinned is None:
                served = ", ".join(sorted({f"{m.digest[:16]}… (step {m.step})" for m in found.values()}))
                raise FetchError(
                    f"the sources serve manifest {served} but the operator announced {digest[:16]}…",
                    [
                        {"shard": None, "source": s, "reason": f"serves {m.digest[:16]}…", "corrupt": False}
                        for s, m in found.items()
                    ],
                )
            return pinned
        best_step = max(m.step for m in found.values())
        votes = collections.Counter(m.digest for m in found.values() if m.step == best_step)
        chosen_digest = votes.most_common(1)[0][0]
        if len(votes) > 1:
            logger.warning(
                "sources disagree on step %d (%d different signed manifests); using %s",
                best_step,
                len(votes),
                chosen_digest[:16],
            )
        return next(m for m in found.values() if m.digest == chosen_digest)

    async def fetch_version(self, resolution: Resolution, plan: SelectionPlan | None = None) -> FetchResult:
        """Fetch the shards of a resolved manifest (those `plan` selects, when given) and, once every one is
        held, move the version into place; a selection short of the whole stays under .partial/."""
        manifest = resolution.manifest
        self.store.check_not_replayed(manifest)
        held = self.store.version_dir(manifest.step)
        if held.exists():
            stored = await asyncio.to_thread(self.store.load_manifest, manifest.step, self.trusted_key)
            if stored.digest != manifest.digest:
                raise StoreError(
                    f"{held} holds another manifest for step {manifest.step} than the sources serve"
                )
            return FetchResult(manifest=manifest, version_dir=held, already_held=True)
        pool = SourcePool(self.sources, self.settings.selection)
        for url, claimants in self.peers.items():
            pool.sources[url].claimed_by(claimants)
        for source in self.sources:
            if source in resolution.pending:  # until it joins; the reason stays if it never does
                why = resolution.errors.get(source, "its manifest had not arrived when the fetch started")
                pool.exclude(source, why)
            elif source not in resolution.serving:
                pool.exclude(source, resolution.errors.get(source, "does not serve this manifest"))
        if plan is None:
            return await self._run(resolution, pool, None)
        return await self._fetch_planned(resolution, pool, plan)

    async def _fetch_planned(
        self, resolution: Resolution, pool: SourcePool, plan: SelectionPlan
    ) -> FetchResult:
        """Rounds of `plan` (selection.py): each names the shards to hold given those verified so far, and is
        fetched, until one names nothing new. Sources keep their measured standing from round to round."""
        manifest = resolution.manifest
        began = time.monotonic()
        rounds: list[FetchResult] = []
        for _ in range(MAX_PLAN_ROUNDS):
            known = await asyncio.to_thread(self.store.holdings, manifest.step)
            have = (
                known.done if known is not None and known.manifest.digest == manifest.digest else frozenset()
            )
            checkpoint = self.store.checkpoint_dir(manifest.step, partial=True)
            chosen = await asyncio.to_thread(plan.choose, manifest, checkpoint, have)
            if rounds and chosen.shards <= have:
                return _merged(rounds, time.monotonic() - began)
            rounds.append(await self._run(resolution, pool, chosen))
            if rounds[-1].complete:  # the plan asked for every shard: the version is in place
                return _merged(rounds, time.monotonic() - began)
        raise FetchError(
            f"the shard selection for step {manifest.step} still grew after {MAX_PLAN_ROUNDS} rounds (a bug)"
        )

    async def _run(
        self, resolution: Resolution, pool: SourcePool, selection: Selection | None
    ) -> FetchResult:
        """One shard run over `pool`: every shard, or those of `selection`."""
        manifest = resolution.manifest
        partial = await asyncio.to_thread(self.store.open_partial, manifest)
        context = FetchContext(
            self.settings,
            self.store,
            self.connections,
            self.on_bytes,
            self.on_shard,
            self.on_manifest,
            ask_manifest=lambda source: self._spawn_manifest(source, manifest.step),
        )
        wanted = None if selection is None or selection.is_whole else selection.shards
        run = ShardRun(context, partial, pool, resolution.pending, resolution.absent, wanted)
        try:
            return await run.execute()
        finally:
            resolution.pending = run.state.joining  # sources still answering may join the next round
            self.dropped_peers.update(run.outcomes.dropped)
            self.disproved += run.peering.disproved
            self.proven.update(
                (s.url, s.node_id)
                for s in pool.sources.values()
                if s.node_id is not None and s.record_ms >= 0 and s.lies == 0 and s.excluded is None
            )


def _merged(rounds: list[FetchResult], seconds: float) -> FetchResult:
    """The last round's result with the counts of every round of a planned fetch."""
    last = rounds[-1]
    last.fetched_bytes = sum(r.fetched_bytes for r in rounds)
    last.received_bytes = sum(r.received_bytes for r in rounds)
    last.resumed_bytes = rounds[0].resumed_bytes
    last.hedges = sum(r.hedges for r in rounds)
    last.hedges_won = sum(r.hedges_won for r in rounds)
    last.seconds = seconds
    last.rounds = len(rounds)
    return last
