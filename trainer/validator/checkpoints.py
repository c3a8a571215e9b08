"""The checkpoint versions a validator verifies against: fetched on policy announcements, kept, loaded.

Each policy the operator announces in the DHT is fetched with the verified multi-source Fetcher
(p2p/weights) into the validator's own store, and used only when its manifest is the announced one;
the newest `keep` versions stay on disk. `model_for(step)` loads a version's engine on first use (in
the verification thread) and caches a few of them, so a file is checked against exactly the checkpoint
it claims. A step the store can never hold again (older than what it already fetched, and pruned or
never fetched) is reported as `gone`, so its files are rejected at once instead of waiting for their
hold to expire.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...node.engine import EngineSettings, InferenceEngine, load_engine
from ...node.run.settings import RunSettings, load_run_tasks, validator_engine
from ...node.run.validation import RunTasks
from ...node.tasks import TaskSet
from ...p2p.errors import P2PError
from ...p2p.identity import Identity
from ...p2p.swarm import PolicyAnnouncement
from ...p2p.weights.fetch import Fetcher, FetchSettings
from ...p2p.weights.store import CHECKPOINT_NAME, Store

logger = logging.getLogger(__name__)


class CheckpointKeeper:
    def __init__(
        self,
        store: Store,
        trusted_key: str,
        run: RunSettings,
        engine: EngineSettings,
        *,
        keep: int,
        cached_engines: int = 2,
        fetch: FetchSettings | None = None,
        identity: Identity | None = None,
        task_set: TaskSet | None = None,
    ) -> None:
        self.store = store
        self.task_set = task_set  # the run's, opened once at start (None: opened with the first checkpoint)
        self.trusted_key = trusted_key
        self.run = run
        self.engine_settings = validator_engine(engine)
        self.keep = keep
        self.cached_engines = cached_engines
        self.fetch_settings = fetch or FetchSettings(keep=keep)
        self.identity = identity  # signs access tokens for the weight servers
        self.latest_policy: int | None = None
        self._engines: OrderedDict[int, InferenceEngine] = OrderedDict()
        self._tasks: RunTasks | None = None
        self._lock = threading.Lock()  # engines are loaded in the worker thread, dropped on the event loop
        self._listeners: list[Callable[[int], None]] = []

    def on_version(self, listener: Callable[[int], None]) -> None:
        """Call `listener(step)` on the event loop whenever a new version is in the store."""
        self._listeners.append(listener)

    def held(self) -> list[int]:
        return self.store.versions()

    def gone(self, step: int) -> bool:
        """True when `step` is not held and the store refuses to fetch it (older than its high-water mark)."""
        return step not in self.store.versions() and step < self.store.high_water()

    def checkpoint_dir(self, step: int) -> Path:
        return self.store.version_dir(step) / CHECKPOINT_NAME

    # ----- in the verification thread ------------------------------------------------------------------

    def model_for(self, step: int) -> tuple[InferenceEngine, RunTasks] | None:
        """The engine of `step` and the run's task rules, or None when the version is not held."""
        with self._lock:
            engine = self._engines.get(step)
            if engine is not None:
                self._engines.move_to_end(step)
                assert self._tasks is not None
                return engine, self._tasks
        directory = self.checkpoint_dir(step)
        if step not in self.store.versions():
            return None
        engine = load_engine(directory, **self.engine_settings.model_dump())
        with self._lock:
            if self._tasks is None:  # the tokenizer is the run's; it does not change between steps
                self._tasks = load_run_tasks(self.run, directory, self.task_set)
            self._engines[step] = engine
            while len(self._engines) > self.cached_engines:
                self._engines.popitem(last=False)
            return engine, self._tasks

    # ----- on the event loop -----------------------------------------------------------------------------

    async def fetch(self, policy: PolicyAnnouncement) -> bool:
        """Fetch the announced version; True when it is now held. Failures are logged, not raised."""
        self.latest_policy = max(self.latest_policy or -1, policy.step)
        if policy.step in self.store.versions():
            self._notify(policy.step)
            return True
        if not policy.sources:
            logger.warning("policy step %d names no weight sources; cannot fetch it", policy.step)
            return False
        fetcher = Fetcher(
            list(policy.sources), self.trusted_key, self.store, self.fetch_settings, identity=self.identity
        )
        try:
            # Pinned to the announced manifest: a source serving another one (even operator-signed) is not used.
            resolution = await fetcher.resolve(policy.step, digest=policy.manifest_sha256)
            result = await fetcher.fetch_version(resolution)
        except P2PError as exc:  # bad manifest or shard, or no source answered: the next policy retries
            logger.warning("could not fetch checkpoint step %d: %s", policy.step, exc)
            return False
        except Exception:  # noqa: BLE001 - a bug reached through a source's answer must not stop the validator
            logger.exception(
                "could not fetch checkpoint step %d: unexpected error (a bug; please report it)", policy.step
            )
            return False
        finally:
            fetcher.close()
        logger.info("checkpoint step %d held at %s", policy.step, result.version_dir)
        removed = await asyncio.to_thread(self.store.prune, self.keep) if self.keep else []
        with self._lock:
            for step in removed:
                self._engines.pop(step, None)
        self._notify(policy.step)
        return True

    def _notify(self, step: int) -> None:
        for listener in self._listeners:
            listener(step)

    async def follow(self, policies: Any) -> None:
        """Fetch every policy `policies` (Swarm.watch_policy()) yields; runs until cancelled."""
        async for policy in policies:
            await self.fetch(policy)
