"""The checkpoint versions a validator verifies against: fetched on policy announcements, kept, loaded.

The newest policy the operator announces in the DHT is fetched into the validator's own store, pinned to the
announced manifest and retried with backoff until held (p2p/weights/pinned.py, as the contributor does); the
newest `keep` versions stay on disk. `model_for(step)` loads a version's engine on first use (in
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
from collections.abc import AsyncIterable, Callable

from ...node.engine import EngineSettings, InferenceEngine, load_engine
from ...node.environments import Environment
from ...node.run.settings import RunSettings, load_run_tasks, validator_engine
from ...node.run.validation import RunTasks
from ...p2p.identity import Identity
from ...p2p.swarm import PolicyAnnouncement
from ...p2p.weights.fetch import FetchSettings
from ...p2p.weights.pinned import Pin, PinnedFetch, PinRefused
from ...p2p.weights.store import Store

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
        environment: Environment | None = None,
        retry_s: float = 5.0,
        max_retry_s: float = 120.0,
    ) -> None:
        self.store = store
        self.environment = (
            environment  # the run's, opened once at start (None: opened with the first checkpoint)
        )
        self.trusted_key = trusted_key
        self.run = run
        self.engine_settings = validator_engine(engine)
        self.keep = keep
        self.cached_engines = cached_engines
        # identity signs access tokens for the weight servers
        self.pinned = PinnedFetch(
            store,
            trusted_key,
            fetch or FetchSettings(keep=keep),
            identity=identity,
            retry_s=retry_s,
            max_retry_s=max_retry_s,
        )
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

    # ----- in the verification thread ------------------------------------------------------------------

    def model_for(self, step: int) -> tuple[InferenceEngine, RunTasks] | None:
        """The engine of `step` and the run's task rules, or None when the version is not held."""
        with self._lock:
            engine = self._engines.get(step)
            if engine is not None:
                self._engines.move_to_end(step)
                assert self._tasks is not None
                return engine, self._tasks
        directory = self.store.checkpoint_dir(step)
        if step not in self.store.versions():
            return None
        engine = load_engine(directory, **self.engine_settings.model_dump())
        with self._lock:
            if self._tasks is None:  # the tokenizer is the run's; it does not change between steps
                self._tasks = load_run_tasks(self.run, directory, self.environment)
            self._engines[step] = engine
            while len(self._engines) > self.cached_engines:
                self._engines.popitem(last=False)
            return engine, self._tasks

    # ----- on the event loop -----------------------------------------------------------------------------

    async def follow(self, policies: AsyncIterable[PolicyAnnouncement]) -> None:
        """Pin every policy `policies` (Swarm.watch_policy()) yields, for `fetch_newest`; runs until cancelled."""
        async for policy in policies:
            self.latest_policy = max(self.latest_policy or -1, policy.step)
            if policy.step in self.store.versions():
                self._notify(policy.step)
            self.pinned.pin(Pin.of(policy))

    async def fetch_newest(self) -> None:
        """Fetch the newest policy whenever it is not held, with backoff after a refusal; runs until cancelled."""
        await self.pinned.run(lambda step: step in self.store.versions(), self.fetch)

    async def fetch(self, pin: Pin) -> bool:
        """Fetch a pinned version; True when it is now held. A refusal is logged (`fetch_newest` retries it)."""
        try:
            await self.pinned.fetch(pin)
        except PinRefused:
            return False
        removed = await asyncio.to_thread(self.store.prune, self.keep) if self.keep else []
        with self._lock:
            for step in removed:
                self._engines.pop(step, None)
        self._notify(pin.step)
        return True

    def _notify(self, step: int) -> None:
        for listener in self._listeners:
            listener(step)
