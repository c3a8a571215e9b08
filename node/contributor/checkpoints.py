"""The node's checkpoints: follow the operator's policy announcements, fetch and verify, keep the window.

An announcement (already signature-checked by the swarm layer against the pinned operator key) names a
step, the SHA-256 of its signed manifest and HTTP sources. A version is used only when the manifest the
sources serve is signed by the operator key, its digest is the announced one, and every shard and file
verified on arrival (p2p/weights). Anything else is refused: logged, counted as a verification failure,
retried later with exponential backoff (a source may heal), and the node keeps working with what it has.
Versions that fell out of the async window are deleted; they can never be used again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from ...p2p.identity import Identity
from ...p2p.swarm.records import PolicyAnnouncement
from ...p2p.weights.errors import WeightsError
from ...p2p.weights.fetch import Fetcher, FetchSettings
from ...p2p.weights.result import FetchResult
from ...p2p.weights.store import CHECKPOINT_NAME, Store
from ..errors import NodeError
from .policy_window import steps_to_delete, usable_step
from .state import NodeState

logger = logging.getLogger(__name__)


class CheckpointRefused(NodeError):
    """An announced checkpoint did not verify; the node keeps using the previous one."""


class CheckpointKeeper:
    def __init__(
        self,
        store: Store,
        operator_key: str,
        state: NodeState,
        *,
        async_level: int,
        fetch_settings: FetchSettings | None = None,
        retry_s: float = 5.0,
        max_retry_s: float = 120.0,
        on_verified: Callable[[int], None] | None = None,
        identity: Identity | None = None,
        peer_sources: Callable[[int], list[str]] | None = None,
    ) -> None:
        self.store = store
        self.operator_key = operator_key
        self.state = state
        self.async_level = async_level
        self.fetch_settings = fetch_settings or FetchSettings()
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.identity = identity  # signs access tokens, so weight servers know (and can ban) this node
        self.on_verified = on_verified  # e.g. tell the weights server and the heartbeat what we can serve
        # Peers whose heartbeats say they serve a step: extra sources. They need no trust: the manifest must
        # still be the operator-signed one the announcement pins, and every shard must hash right.
        self.peer_sources = peer_sources
        self.announced: PolicyAnnouncement | None = None
        self._verified: set[int] = set()
        self._retry_at: dict[int, tuple[float, float]] = {}  # step -> (monotonic time of next try, delay)
        self.changed = asyncio.Event()  # set when the announcement or the verified set changes

    # ----- local state -----------------------------------------------------------------------------------

    async def load_local(self) -> None:
        """Reuse versions verified in an earlier run: their manifests must still verify against the key."""
        for step in await asyncio.to_thread(self.store.versions):
            try:
                await asyncio.to_thread(self.store.load_manifest, step, self.operator_key)
            except (WeightsError, OSError, ValueError) as exc:
                logger.warning("ignoring local checkpoint step %d: %s", step, exc)
                continue
            self._verified.add(step)
        self._publish_local()
        if self._verified:
            logger.info("reusing verified checkpoints %s from %s", sorted(self._verified), self.store.root)

    def verified_steps(self) -> list[int]:
        return sorted(self._verified)

    def checkpoint_dir(self, step: int) -> Path:
        return self.store.version_dir(step) / CHECKPOINT_NAME

    def usable_step(self) -> int | None:
        """The step the rollout loop may generate with now (None: wait)."""
        announced = self.announced.step if self.announced else None
        return usable_step(announced, self._verified, self.async_level)

    def discard(self, step: int, reason: str) -> None:
        """Stop using a verified step (e.g. the engine cannot load it); it stays refused until restart."""
        self._verified.discard(step)
        self._retry_at[step] = (float("inf"), self.max_retry_s)  # never fetched again by this process
        message = f"checkpoint step {step} unusable: {reason}"
        self.state.error(message)
        logger.error("%s", message)
        self._publish_local()

    def _publish_local(self) -> None:
        self.state.set_local(max(self._verified) if self._verified else None)
        self.changed.set()

    # ----- announcements -------------------------------------------------------------------------------

    def announce(self, policy: PolicyAnnouncement) -> None:
        if self.announced is not None and policy.step <= self.announced.step:
            return  # an older or repeated step (re-announced with the same run parameters) changes nothing
        self.announced = policy
        self.state.set_announced(policy.step)
        logger.debug("policy step %d announced (manifest %s…)", policy.step, policy.manifest_sha256[:16])
        self.changed.set()

    async def run(self) -> None:
        """Fetch the announced checkpoint whenever it is not held yet, with backoff after a refusal."""
        while True:
            self.changed.clear()
            policy = self.announced
            wait = 3600.0
            if policy is not None and policy.step not in self._verified:
                due, _ = self._retry_at.get(policy.step, (0.0, 0.0))
                if time.monotonic() >= due:
                    await self.try_fetch(policy)
                    continue
                wait = min(3600.0, due - time.monotonic())
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=max(0.05, wait))
            except TimeoutError:
                pass

    async def try_fetch(self, policy: PolicyAnnouncement) -> bool:
        """Fetch and verify `policy`; False (logged, counted, retried later) when it is refused."""
        self.state.state = f"downloading checkpoint step {policy.step}"
        try:
            result = await self.fetch(policy)
        except (CheckpointRefused, WeightsError, OSError) as exc:
            self._refused(policy, str(exc))
            return False
        except Exception as exc:  # noqa: BLE001 - whatever a source sent, this task (and the node) goes on
            logger.exception(
                "checkpoint step %d: unexpected error while fetching (a bug; please report it)", policy.step
            )
            self._refused(policy, f"unexpected error: {type(exc).__name__}: {exc}")
            return False
        self._retry_at.pop(policy.step, None)
        self._verified.add(policy.step)
        logger.info(
            "checkpoint step %d verified (%d bytes in %.1f s)",
            policy.step,
            result.manifest.body.total_size,
            result.seconds,
        )
        await self.prune()
        self._publish_local()
        if self.on_verified is not None:
            self.on_verified(policy.step)
        return True

    def _refused(self, policy: PolicyAnnouncement, reason: str) -> None:
        """Count and show a failed fetch, and back off before the next try (a source may heal)."""
        _, delay = self._retry_at.get(policy.step, (0.0, self.retry_s / 2))
        delay = min(self.max_retry_s, delay * 2)
        self._retry_at[policy.step] = (time.monotonic() + delay, delay)
        self.state.metrics.verification_failures.inc()
        message = f"checkpoint step {policy.step} refused: {reason}"
        self.state.error(message)
        logger.warning("%s; keeping the previous checkpoint, retrying in %.0f s", message, delay)

    async def fetch(self, policy: PolicyAnnouncement) -> FetchResult:
        if not policy.sources:
            raise CheckpointRefused("the announcement names no sources")
        sources = list(policy.sources)
        if self.peer_sources is not None:
            sources += [url for url in self.peer_sources(policy.step) if url not in sources]
        fetcher = Fetcher(
            sources,
            self.operator_key,
            self.store,
            self.fetch_settings,
            identity=self.identity,
            on_bytes=self.state.metrics.download_bytes.inc,
        )
        try:
            # The manifest is signed by the operator, but the announcement pins which one: a source that serves
            # another (older, or a different build of the same step) is not used; none serving it is a refusal.
            resolution = await fetcher.resolve(policy.step, digest=policy.manifest_sha256)
            return await fetcher.fetch_version(resolution)
        finally:
            fetcher.close()

    async def prune(self) -> None:
        """Delete versions that fell out of the window (and never re-fetch them: the store's high water)."""
        announced = self.announced.step if self.announced else None
        doomed = steps_to_delete(self._verified, announced, self.async_level)
        if not doomed:
            return
        keep = len([s for s in await asyncio.to_thread(self.store.versions) if s > max(doomed)])
        removed = await asyncio.to_thread(self.store.prune, max(1, keep))
        self._verified.difference_update(removed)
        logger.debug("deleted checkpoints %s (outside the async window of %d)", removed, self.async_level)
