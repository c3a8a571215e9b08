"""Fetching the version a trusted announcement pins, by (step, manifest digest), into a store.

The operator's signed policy announcement names a step, the SHA-256 of its signed manifest and HTTP sources.
Every role that follows the policy (the contributor, the validator) fetches it the same way: with the
verified multi-source Fetcher (fetch.py), pinned to the announced manifest, so a source serving another one
(an older build of the same step, even operator-signed) is not used and none serving it is a refusal. A
refusal, whatever a source sent, is logged and retried later with exponential backoff (a source may heal);
it never ends the caller's task. `run` follows the newest pin until it is held. With a selection plan
(selection.py: a pipeline node's stages) only the shards it names are fetched and the version is held in part.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from ..identity import Identity
from .claims import Disproved, PeerClaims
from .errors import WeightsError
from .fetch import Fetcher, FetchSettings
from .manifest import SignedManifest
from .result import FetchResult
from .selection import SelectionPlan
from .store import Store

logger = logging.getLogger(__name__)

IDLE_WAKE_S = 3600.0  # with nothing to fetch, `run` still looks again this often (a missed wake-up heals)
# Disproved claims remembered so that each is logged and counted once (a bound on a long-lived node's memory).
MAX_DISPROVED_KEPT = 4096


class Announcement(Protocol):
    """What a pin is read from: the swarm's PolicyAnnouncement (p2p/swarm/records.py) has these fields."""

    @property
    def step(self) -> int: ...
    @property
    def manifest_sha256(self) -> str: ...
    @property
    def sources(self) -> list[str]: ...


@dataclass(frozen=True)
class Pin:
    """A version as a trusted announcement names it."""

    step: int
    digest: str  # SHA-256 of the signed manifest: the only manifest of `step` that may be used
    sources: tuple[str, ...]  # where the announcement says it is served

    @classmethod
    def of(cls, announcement: Announcement) -> Pin:
        return cls(announcement.step, announcement.manifest_sha256, tuple(announcement.sources))


class PinRefused(WeightsError):
    """A pinned version was not fetched: no source served exactly it, or what they served did not verify."""

    def __init__(self, step: int, reason: str, retry_in_s: float) -> None:
        super().__init__(f"checkpoint step {step} refused: {reason}")
        self.step = step
        self.reason = reason
        self.retry_in_s = retry_in_s  # when this step may be tried again (inf: never, in this process)


class PinnedFetch:
    """Fetches pinned versions signed by `trusted_key` into `store`; a refused step waits `retry_s`, doubling
    up to `max_retry_s`, before its next try."""

    def __init__(
        self,
        store: Store,
        trusted_key: str,
        settings: FetchSettings | None = None,
        *,
        identity: Identity | None = None,
        on_bytes: Callable[[int], None] | None = None,
        on_manifest: Callable[[SignedManifest, int], None] | None = None,
        on_shard: Callable[[int], None] | None = None,
        peer_sources: Callable[[int], PeerClaims] | None = None,
        on_disproved: Callable[[str, Disproved], None] | None = None,
        on_proven: Callable[[str, str], None] | None = None,
        plan: SelectionPlan | None = None,
        retry_s: float = 5.0,
        max_retry_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.trusted_key = trusted_key
        self.settings = settings or FetchSettings()
        self.identity = identity  # signs access tokens, so weight servers know (and can ban) who fetches
        self.on_bytes = on_bytes  # progress: called with each received chunk's size
        self.on_manifest = on_manifest  # progress: (manifest, bytes resumed) before its shards are fetched
        self.on_shard = (
            on_shard  # each shard index once it verified (a node re-serving it: serve_verified.py)
        )
        # Peers that say they serve a step (URL -> the node ids whose heartbeats name it): extra sources. They
        # need no trust: the manifest must still be the pinned one, signed by the trusted key, each is asked only
        # for the shards a current record signed by one of its claimants claims, and every shard must hash right
        # (fetch.py).
        self.peer_sources = peer_sources
        # Called with (claimant, proof) once per (URL, claimant) that a contested server proved not to be
        # (claims.py): the node counts them in a metric.
        self.on_disproved = on_disproved
        # Called with (URL, node id) for each peer URL a fetch found that node serving at (`Fetcher.proven`).
        self.on_proven = on_proven
        # Which shards to hold (a pipeline node's stages): None fetches every shard, the version whole.
        self.plan = plan
        # (URL, a claimant it is not) -> the node it proved to be
        self.disproved: dict[tuple[str, str], str] = {}
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._clock = clock
        self._retry_at: dict[int, tuple[float, float]] = {}  # step -> (clock time of next try, last delay)
        # Peers a fetch caught sending bytes that do not match the signed manifest (node id -> why): never a
        # source again for this object's life, so a hostile peer costs at most one shard, once.
        self.dropped_peers: dict[str, str] = {}
        self.pinned: Pin | None = None  # the newest pin `run` follows
        self._changed = asyncio.Event()

    # ----- one fetch -----------------------------------------------------------------------------------------

    def retry_in(self, step: int) -> float:
        """Seconds until `step` may be tried again: 0.0 when it may be now, inf once given up on."""
        due, _ = self._retry_at.get(step, (0.0, 0.0))
        return max(0.0, due - self._clock())

    def never_again(self, step: int) -> None:
        """Give up on `step` for the life of this object (e.g. its verified files cannot be loaded)."""
        self._retry_at[step] = (float("inf"), self.max_retry_s)
        self._changed.set()

    async def fetch(self, pin: Pin) -> FetchResult:
        """Fetch and verify exactly the pinned version (or find it already held); PinRefused when not."""
        try:
            result = await self._fetch(pin)
        except (WeightsError, OSError) as exc:
            raise self._refused(pin.step, str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - whatever a source sent, the caller's task goes on
            logger.exception(
                "checkpoint step %d: unexpected error while fetching (a bug; please report it)", pin.step
            )
            raise self._refused(pin.step, f"unexpected error: {type(exc).__name__}: {exc}") from exc
        self._retry_at.pop(pin.step, None)
        total = result.manifest.body.total_size
        if result.complete:
            logger.info(
                "checkpoint step %d verified (%d bytes in %.1f s) at %s",
                pin.step,
                total,
                result.seconds,
                result.version_dir,
            )
        else:
            logger.info(
                "checkpoint step %d: the %d of %d shards selected verified (%d of %d bytes held, %.1f%%; %d "
                "fetched in %.1f s over %d rounds) at %s",
                pin.step,
                len(result.held or ()),
                len(result.manifest.body.shards),
                result.held_bytes,
                total,
                100 * result.held_bytes / total,
                result.fetched_bytes,
                result.seconds,
                result.rounds,
                result.version_dir,
            )
        return result

    async def _fetch(self, pin: Pin) -> FetchResult:
        sources = list(pin.sources)
        peers: dict[str, frozenset[str]] = {}
        if self.peer_sources is not None:
            # A URL the operator announced stays an announced source even if a peer names it too (compared
            # without a trailing slash, as the fetcher uses them). A dropped peer's claims are left out: a URL
            # only it names is not asked, and one it contests is bound to another claimant or to nobody.
            announced = {s.rstrip("/") for s in sources}
            for url, claimants in self.peer_sources(pin.step).items():
                kept = frozenset(claimants).difference(self.dropped_peers)
                if url.rstrip("/") not in announced and kept:
                    peers[url] = kept
            sources += list(peers)
        if not sources:
            raise WeightsError("the announcement names no sources")
        fetcher = Fetcher(
            sources,
            self.trusted_key,
            self.store,
            self.settings,
            identity=self.identity,
            on_bytes=self.on_bytes,
            on_shard=self.on_shard,
            peers=peers,
        )
        fetcher.on_manifest = self.on_manifest
        try:
            resolution = await fetcher.resolve(pin.step, digest=pin.digest)
            return await fetcher.fetch_version(resolution, self.plan)
        finally:
            fetcher.close()
            for node_id, why in fetcher.dropped_peers.items():
                if node_id not in self.dropped_peers:
                    logger.warning("not fetching from peer %s… again: %s", node_id[:16], why)
                    self.dropped_peers[node_id] = why
            for proof in fetcher.disproved:
                self._note_disproved(proof)
            if self.on_proven is not None:
                for url, node_id in fetcher.proven.items():
                    self.on_proven(url, node_id)

    def _note_disproved(self, proof: Disproved) -> None:
        """Log and report, once per (URL, claimant), a peer whose heartbeat names a server that proved to be
        another node's. Not banned: a node that moved names its old address until its next heartbeat."""
        for other in sorted(proof.others):
            if self.disproved.get((proof.url, other)) == proof.owner:
                continue
            self.disproved[(proof.url, other)] = proof.owner
            if len(self.disproved) > MAX_DISPROVED_KEPT:  # peers come and go: forget the oldest
                del self.disproved[next(iter(self.disproved))]
            logger.warning(
                "peer %s… names %s as its weights server, but that server signs as peer %s…: a false claim, "
                "or a heartbeat from before an address change; the server is used as %s…'s",
                other[:16],
                proof.url,
                proof.owner[:16],
                proof.owner[:16],
            )
            if self.on_disproved is not None:
                self.on_disproved(other, proof)

    def _refused(self, step: int, reason: str) -> PinRefused:
        _, delay = self._retry_at.get(step, (0.0, self.retry_s / 2))
        delay = min(self.max_retry_s, delay * 2)
        self._retry_at[step] = (self._clock() + delay, delay)
        refused = PinRefused(step, reason, delay)
        logger.warning("%s; keeping what is held, retrying in %.1f s", refused, delay)
        return refused

    # ----- following the newest pin ------------------------------------------------------------------------

    def pin(self, pin: Pin) -> bool:
        """Follow `pin` from now on if it is newer than the one followed; True when it is."""
        if self.pinned is not None and pin.step <= self.pinned.step:
            return False
        self.pinned = pin
        self._changed.set()
        return True

    async def run(self, held: Callable[[int], bool], attempt: Callable[[Pin], Awaitable[object]]) -> None:
        """Call `attempt(pin)` for the newest pin whenever `held(step)` says it is not held and its backoff is
        over; runs until cancelled. `attempt` fetches through `fetch`, which schedules the next try."""
        while True:
            self._changed.clear()
            pin = self.pinned
            wait = IDLE_WAKE_S
            if pin is not None and not held(pin.step):
                wait = self.retry_in(pin.step)
                if wait <= 0:
                    await attempt(pin)
                    continue
            try:
                async with asyncio.timeout(max(0.05, min(IDLE_WAKE_S, wait))):
                    await self._changed.wait()
            except TimeoutError:
                pass
