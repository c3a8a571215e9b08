"""The node's checkpoints: follow the operator's policy announcements, fetch and verify, keep the window.

An announcement (already signature-checked by the swarm layer against the pinned operator key) names a
step, the SHA-256 of its signed manifest and HTTP sources. A version is used only when the manifest the
sources serve is signed by the operator key, its digest is the announced one, and every shard and file
verified on arrival (p2p/weights/pinned.py). Anything else is refused: logged, counted as a verification
failure, retried later with exponential backoff (a source may heal), and the node keeps working with what it
has. Versions that fell out of the async window are deleted; they can never be used again.

A pipeline node fetches with a selection plan (node/pipeline/weights.py `StageSelection`): only the shards of
the stages it offers, the version held in part under the store's .partial/ (p2p/weights/selection.py). Its
stages load from there (`checkpoint_dir`); a monolithic load goes through `whole_checkpoint_dir`, which refuses
such a version naming the shards it lacks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from ...p2p.errors import P2PError
from ...p2p.identity import Identity
from ...p2p.swarm.records import PolicyAnnouncement
from ...p2p.weights.claims import Disproved, PeerClaims
from ...p2p.weights.errors import StoreError, WeightsError
from ...p2p.weights.fetch import FetchSettings
from ...p2p.weights.manifest import SignedManifest
from ...p2p.weights.pinned import Pin, PinnedFetch, PinRefused
from ...p2p.weights.selection import SelectionPlan
from ...p2p.weights.serve_verified import ServeAsVerified
from ...p2p.weights.store import Holdings, Store
from ..errors import NodeError
from ..runtime.progress import DownloadProgress
from .policy_window import steps_to_delete, usable_step
from .state import NodeState

logger = logging.getLogger(__name__)


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
        peer_sources: Callable[[int], PeerClaims] | None = None,
        on_proven: Callable[[str, str], None] | None = None,
        download_bar_after_s: float | None = None,
        serve: ServeAsVerified | None = None,
        plan: SelectionPlan | None = None,
    ) -> None:
        self.store = store
        self.operator_key = operator_key
        self.state = state
        self.async_level = async_level
        self.on_verified = on_verified  # e.g. tell the weights server and the heartbeat what we can serve
        # A node that re-serves weights offers each shard of a version it is fetching as soon as it verified.
        self.serve = serve
        # identity signs access tokens, so weight servers know (and can ban) this node; peer sources are the
        # peers whose heartbeats say they serve a step (URL -> the node ids naming it; a server several name is
        # bound to the one it proves to be, and the others are counted).
        self.pinned = PinnedFetch(
            store,
            operator_key,
            fetch_settings,
            identity=identity,
            on_bytes=self._on_bytes,
            on_manifest=self._on_manifest,
            on_shard=serve.on_shard if serve is not None else None,
            peer_sources=peer_sources,
            on_disproved=self._on_disproved,
            on_proven=on_proven,  # the peers a fetch found serving where they say: drawn first next time
            plan=plan,
            retry_s=retry_s,
            max_retry_s=max_retry_s,
        )
        self.announced: PolicyAnnouncement | None = None
        self._verified: set[int] = set()
        # Verified steps held only in part (the plan's shards), under the store's .partial/.
        self._in_part: set[int] = set()
        self._fetching: int | None = None  # the step a fetch is writing under .partial/: never pruned
        # A bar on stderr for a download still running after this many seconds (None: never, as under
        # --log-json; tqdm leaves out a stderr that is not a terminal by itself).
        self.download_bar_after_s = download_bar_after_s
        self._bar: DownloadProgress | None = None

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
        for step in await asyncio.to_thread(self.store.partial_versions):
            if step in self._verified:
                continue
            held = await asyncio.to_thread(self._take_up, step)
            if held is not None:
                self._verified.add(step)
                self._in_part.add(step)
                if self.serve is not None:  # its shards are served again, as before the restart
                    self.serve.offer_held(held.manifest, held.done)
        self._publish_local()
        if self._verified:
            logger.info("reusing verified checkpoints %s from %s", sorted(self._verified), self.store.root)

    def _take_up(self, step: int) -> Holdings | None:
        """What the partial version of `step` left by an earlier run holds, when it is to be used again: every
        shard the plan names (a selective fetch that finished, not one cut short) under a manifest that verifies
        against the operator key. Otherwise None; and the version is deleted, logged, when it can never be of
        use: its journal or manifest damaged (a later fetch could not resume it either), or its step below the
        store's high water (no fetch of it is ever started again, so it could never be finished). A fetch cut
        short at a newer step is kept, for the next fetch to resume. Blocking."""
        try:
            held = self.store.holdings(step)
        except StoreError as exc:
            self._delete_partial(step, f"it cannot be read ({exc})")
            return None
        plan = self.pinned.plan
        if held is not None and plan is not None:
            try:
                self.store.load_manifest(step, self.operator_key, partial=True)
                chosen = plan.choose(held.manifest, self.store.checkpoint_dir(step, partial=True), held.done)
            except (P2PError, NodeError, OSError) as exc:
                logger.warning("ignoring the partial checkpoint step %d: %s", step, exc)
                return None
            if chosen.shards <= held.done:
                return held
        if step < self.store.high_water():
            self._delete_partial(
                step, "its fetch was cut short and a newer step is held, so it is never resumed"
            )
        return None

    def _delete_partial(self, step: int, why: str) -> None:
        logger.warning("deleting the partial checkpoint step %d: %s", step, why)
        self.store.discard_partial(step)

    def checkpoint_dir(self, step: int) -> Path:
        """Where verified step `step`'s files lie: the complete version, or the one held in part (a pipeline
        stage's loader checks it holds what it reads)."""
        if step in self._in_part and not self.store.version_dir(step).exists():
            return self.store.checkpoint_dir(step, partial=True)
        return self.store.checkpoint_dir(step)

    def whole_checkpoint_dir(self, step: int) -> Path:
        """Step `step`'s checkpoint for a monolithic load; IncompleteVersion when only part of it is held."""
        return self.store.whole_checkpoint_dir(step)

    def verified_steps(self) -> list[int]:
        return sorted(self._verified)

    def usable_step(self) -> int | None:
        """The step the rollout loop may generate with now (None: wait)."""
        announced = self.announced.step if self.announced else None
        return usable_step(announced, self._verified, self.async_level)

    def discard(self, step: int, reason: str) -> None:
        """Stop using a verified step (e.g. the engine cannot load it); it stays refused until restart."""
        self._verified.discard(step)
        self.pinned.never_again(step)  # never fetched again by this process
        message = f"checkpoint step {step} unusable: {reason}"
        self.state.error(message)
        logger.error("%s", message)
        self._publish_local()

    def _publish_local(self) -> None:
        self.state.set_local(max(self._verified) if self._verified else None)

    def _on_bytes(self, count: int) -> None:
        self.state.metrics.download_bytes.inc(count)
        if self._bar is not None:
            self._bar.on_bytes(count)

    def _on_disproved(self, claimant: str, proof: Disproved) -> None:
        self.state.metrics.weights_claims_disproved.inc()

    def _on_manifest(self, manifest: SignedManifest, resumed: int) -> None:
        if self.serve is not None:
            self.serve.on_manifest(manifest, resumed)
        if self._bar is not None:
            self._bar.on_manifest(manifest, resumed)

    # ----- announcements -------------------------------------------------------------------------------

    def announce(self, policy: PolicyAnnouncement) -> None:
        if not self.pinned.pin(Pin.of(policy)):
            return  # an older or repeated step (re-announced with the same run parameters) changes nothing
        self.announced = policy
        self.state.set_announced(policy.step)
        logger.debug("policy step %d announced (manifest %s…)", policy.step, policy.manifest_sha256[:16])

    async def run(self) -> None:
        """Fetch the announced checkpoint whenever it is not held yet, with backoff after a refusal."""
        await self.pinned.run(lambda step: step in self._verified, self._try)

    async def try_fetch(self, policy: PolicyAnnouncement) -> bool:
        """Fetch and verify `policy`; False (logged, counted, retried later) when it is refused."""
        return await self._try(Pin.of(policy))

    async def _try(self, pin: Pin) -> bool:
        self.state.state = f"downloading checkpoint step {pin.step}"
        self._fetching = pin.step
        try:
            return await self._fetch(pin)
        finally:
            self._fetching = None

    async def _fetch(self, pin: Pin) -> bool:
        if self.download_bar_after_s is not None:
            self._bar = DownloadProgress(delay_s=self.download_bar_after_s, leave=False)
        try:
            result = await self.pinned.fetch(pin)
        except PinRefused as refused:
            if self.serve is not None:
                self.serve.abandoned()
            self.state.metrics.verification_failures.inc()
            self.state.error(str(refused))
            await self.prune()  # a refused fetch of a step now out of the window leaves nothing behind
            return False
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        if self.serve is not None and not result.already_held:
            self.serve.finished(result)
        self.state.metrics.held_fraction.set(result.held_bytes / result.manifest.body.total_size)
        if result.complete:
            self._in_part.discard(pin.step)
        else:
            self._in_part.add(pin.step)
        self._verified.add(pin.step)
        await self.prune()
        self._publish_local()
        if self.on_verified is not None:
            self.on_verified(pin.step)
        return True

    async def prune(self) -> None:
        """Delete versions that fell out of the window (and never re-fetch them: the store's high water), and
        any partial version below it (one held in part, or a fetch refused or cut short) but the one being
        fetched: nothing else ever deletes a partial version while no complete one is newer."""
        announced = self.announced.step if self.announced else None
        if announced is None:
            return
        floor = announced - self.async_level
        doomed = steps_to_delete(self._verified, announced, self.async_level)
        removed: list[int] = []
        if doomed:
            keep = len([s for s in await asyncio.to_thread(self.store.versions) if s > max(doomed)])
            removed = await asyncio.to_thread(self.store.prune, max(1, keep))
        stale = [
            step
            for step in await asyncio.to_thread(self.store.partial_versions)
            if step < floor and step != self._fetching
        ]
        for step in stale:
            if step in self._in_part and self.serve is not None:
                self.serve.withdraw(step)
            await asyncio.to_thread(self.store.discard_partial, step)
            if step in self._in_part:
                self._in_part.discard(step)
                removed.append(step)
        self._verified.difference_update(removed)
        if removed or stale:
            logger.debug(
                "deleted checkpoints %s and partial versions %s (outside the async window of %d)",
                sorted(set(removed)),
                stale,
                self.async_level,
            )
