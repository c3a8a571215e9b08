"""`prime-node trainer` as a service: origin of the weights, announcer of policies, consumer of accepted rollouts.

Start-up: resume (or genesis, step 0) -> publish the current checkpoint if the store lacks it -> serve the store
over HTTP (WeightsServer) -> join the DHT and announce the signed policy -> start the training loop.
The loop reads the validator's inbox (trainer/service/inbox.py) into the BatchBuffer inside the async window; whenever a
batch is ready it trains one rollout step, saves and publishes checkpoint N + 1, announces it, commits the batch
in the consumed record, and logs the step's metrics. Torch and disk work run in one worker thread at a time
(the Learner is not thread-safe, and the event loop must stay free to serve shards).

Shutdown (SIGTERM, SIGINT, max_steps, or a crashed task) goes through the Supervisor: tasks are cancelled in
reverse order, the DHT is left, the server is stopped. A step cancelled midway is simply not committed; the
next start resumes from the newest complete state, so nothing is lost or used twice.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ...node.run.announcement import run_parameters
from ...node.run.settings import load_run_tasks, open_run_environment
from ...node.runtime.metrics import serve_metrics
from ...node.runtime.supervisor import Supervisor
from ...p2p.errors import P2PError
from ...p2p.identity import Identity
from ...p2p.swarm import PolicyAnnouncement, RecordError, RunParameters, Swarm
from ...p2p.swarm.records import RecordKind, payload_of
from ...p2p.urls import loopback_behind, routable_url
from ...p2p.weights.server import WeightsServer
from ...p2p.weights.store import Store
from ..errors import TrainerError
from ..groups.coordinator import GroupCoordinator
from .batch_buffer import Batch, BatchBuffer
from .config import TrainerCommandSettings
from .consumed import ConsumedLedger
from .inbox import Inbox
from .learner import Learner
from .metrics import StepLog, StepRecord, TrainerMetrics, progress_line

logger = logging.getLogger(__name__)
T = TypeVar("T")

SHUTDOWN_S = 30.0


@dataclass
class Running:
    """What a started trainer exposes to the CLI and to tests."""

    node_id: str
    step: int
    weights_url: str  # where the server is bound
    maddrs: list[str]
    metrics_url: str | None
    sources: list[str]  # the weights URLs announced to peers (public, or derived from the bound one)

    def ready_line(self) -> str:
        return json.dumps(
            {
                "trainer": self.node_id,
                "step": self.step,
                "weights": self.weights_url,
                "sources": self.sources,
                "maddrs": self.maddrs,
                "metrics": self.metrics_url,
            }
        )


def check_policy_fits(sources: list[str], run: RunParameters) -> None:
    """TrainerError at start-up, not at some later step, when the policy record announcing `sources` and `run`
    would be too large for the DHT (its size grows with the step number): measured with a 16-digit step."""
    widest = PolicyAnnouncement(
        step=10**15,
        manifest_sha256="0" * 64,
        sources=sources,
        published_at=time.time(),
        run=run,
        frozen=run.run_kind == "synthetic",
    )
    try:
        payload_of(RecordKind.POLICY, widest)
    except RecordError as exc:
        raise TrainerError(
            f"{exc}: announce fewer or shorter service.public_sources ({len(sources)} now)"
        ) from None


def weights_sources(settings: TrainerCommandSettings, bound_url: str) -> list[str]:
    """The weights URLs each policy announces: the operator's public ones (`--public-weights-url`), else the
    server's own URL, its host made dialable when it binds every interface (0.0.0.0) by the IP of the first
    `--announce-maddrs` address. TrainerError at start-up when peers would be told an address nobody can dial."""
    svc = settings.service
    if svc.public_sources:
        return list(svc.public_sources)
    url = routable_url(bound_url, settings.swarm.announce_maddrs)
    if url is None:
        if svc.dht:
            raise TrainerError(
                f"the weights server binds every interface ({bound_url}), which no peer can dial: give its "
                "public address with --public-weights-url http://<public ip or name>:<port>, or "
                "--announce-maddrs /ip4/<public ip>/tcp/<port> to take the IP from there"
            )
        return [bound_url]  # nothing is announced without the DHT: the URL is only shown
    far = loopback_behind(url, settings.swarm.announce_maddrs)
    if svc.dht and far is not None:
        logger.warning(
            "the weights server listens on %s only, but the trainer announces %s: peers on other machines "
            "cannot download checkpoints; bind it with --http-host 0.0.0.0 (docs/deploy.md)",
            url,
            far,
        )
    return [url]


class TrainerService:
    def __init__(
        self,
        settings: TrainerCommandSettings,
        identity: Identity,
        model_dir: Path,
        supervisor: Supervisor,
        on_step: Callable[[StepRecord], None] | None = None,
        learner_factory: Callable[..., Learner] | None = None,
    ) -> None:
        self.settings = settings
        self.model_dir = model_dir
        self.on_step = on_step  # the CLI's progress display
        self.identity = identity
        self.supervisor = supervisor
        svc = settings.service
        # One worker thread for everything blocking: the Learner is not thread-safe, and shutdown can wait for
        # a step in flight to finish before the consumed record is closed under it.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-step")
        self.store = Store(settings.path(svc.weights_dir, "weights"))
        state_root = settings.path(svc.state_dir, "trainer")
        self.ledger = ConsumedLedger(state_root / "consumed.sqlite")
        # --fsdp passes trainer/service/fsdp_learner.py's FsdpLearner: the same calls, with the model sharded
        # over ranks.
        make = learner_factory or Learner
        self.learner = make(
            settings.trainer,
            model_dir,
            state_root / "states",
            self.store,
            self.ledger,
            identity,
            settings.run.run_id,
        )
        t = settings.trainer
        self.buffer = BatchBuffer(
            self.ledger,
            batch_size=t.batch_size,
            async_level=t.async_level,
            advantage_eps=t.advantage_eps,
            max_buffered_samples=t.max_buffered_samples,
        )
        self.inbox = Inbox(
            settings.path(svc.accepted_dir, "accepted"),
            settings.run.run_id,
            temperature=settings.run.temperature,
        )
        self.metrics = TrainerMetrics()
        self.log = StepLog(state_root / "metrics.jsonl")
        self.swarm: Swarm | None = None
        self.server: WeightsServer | None = None
        self.sources: list[str] = []
        self.run_parameters: RunParameters | None = None  # announced with every policy; read at start
        # Task rewards of every sample read since the last step, filtered groups included: unlike the batch's
        # reward (only groups whose rewards differ, so near 0.5 by construction) it follows the policy's skill.
        self._rollout_rewards: list[float] = []

    async def start(self) -> Running:
        svc = self.settings.service
        if svc.threads is not None:
            import torch

            torch.set_num_threads(svc.threads)
        self.supervisor.on_shutdown("consumed-record", self._close_ledger)
        # An address no peer can dial stops the trainer now, before the model loads, not after.
        weights_sources(self.settings, f"http://{self.settings.serve.host}:{self.settings.serve.port}")
        # Opens the run's environment: fails at start-up, not hours later, when it is unreadable.
        environment = await asyncio.to_thread(open_run_environment, self.settings.run)
        self.run_parameters = run_parameters(self.settings.run, environment)
        # Builds a prompt as every node and validator will (the model's chat template, the run's system
        # prompt): a template that cannot render them stops the trainer here, before any policy is announced.
        await asyncio.to_thread(load_run_tasks, self.settings.run, self.model_dir, environment)
        step = await self._blocking(self.learner.resume)
        self.metrics.step.set(step)
        self.server = server = WeightsServer(
            self.store, self.settings.serve, trusted_key=self.identity.node_id, metrics=self.metrics.weights
        )
        url = await server.start()
        self.supervisor.on_shutdown("weights-server", server.stop)
        if server.scanner is not None:  # its rescans: a crash stops the trainer instead of serving less
            self.supervisor.supervise(server.scanner)
        self.sources = weights_sources(self.settings, url)
        assert self.run_parameters is not None
        check_policy_fits(self.sources, self.run_parameters)
        for source in self.sources:
            server.accept_audience(source)
        maddrs: list[str] = []
        if svc.dht:
            self.swarm = Swarm(self.settings.swarm, self.identity, roles=("trainer",))
            self.supervisor.on_shutdown("swarm", self.swarm.leave)
            await self.swarm.join()
            self.supervisor.supervise(*self.swarm.tasks.values())  # its heartbeat
            maddrs = [] if self.swarm.client_mode else await self.swarm.maddrs()
            await self._announce()
            self.supervisor.spawn("policy-reannounce", self._reannounce())
            self.supervisor.spawn("ban-watch", self._watch_bans())
            self._start_groups()
        metrics_url = None
        if svc.metrics_port is not None:
            runner, metrics_url = await serve_metrics(
                self.metrics.registry, svc.metrics_host, svc.metrics_port
            )
            self.supervisor.on_shutdown("metrics-server", runner.cleanup)
        if self.settings.run.frozen:
            # A synthetic run: the model announced above is the run's for good. Accepted files stay in the
            # inbox, where `prime-node dataset build` reads them (docs/synthetic.md).
            logger.info("synthetic run: policy step %d is frozen; no training", step)
        else:
            self.supervisor.spawn("train-loop", self._loop())
        return Running(self.identity.node_id, step, url, maddrs, metrics_url, self.sources)

    def _start_groups(self) -> None:
        """The group coordinator (trainer/groups/): here because group records need the operator key."""
        layout = self.run_parameters.pipeline if self.run_parameters is not None else None
        if self.swarm is None or layout is None or not self.settings.groups.enabled:
            return
        swarm, learner = self.swarm, self.learner
        coordinator = GroupCoordinator(
            swarm,
            layout,
            lambda: learner.manifest.step if learner.manifest is not None else None,
            self.settings.groups.plan_settings(),
            poll_s=self.settings.groups.poll_s,
        )
        self.supervisor.spawn("group-coordinator", coordinator.run())

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, functools.partial(fn, *args))

    async def _close_ledger(self) -> None:
        await asyncio.to_thread(self._worker.shutdown, True)  # a cancelled step still runs to its end
        self.ledger.close()

    async def _announce(self) -> None:
        if self.swarm is None or self.learner.manifest is None or self.run_parameters is None:
            return
        manifest = self.learner.manifest
        self.swarm.policy_step = manifest.step
        self.swarm.serves_steps = self.store.versions()
        if not await self.swarm.publish_policy(
            manifest.step, manifest.digest, self.sources, self.run_parameters
        ):
            logger.warning(
                "policy step %d was not stored in the DHT; retrying at the next announcement", manifest.step
            )

    async def _reannounce(self) -> None:
        while not await self.supervisor.sleep_or_stop(self.settings.service.announce_interval_s):
            await self._announce()

    async def _watch_bans(self) -> None:
        """Refuse weight requests from nodes the operator banned (signed bans in the DHT)."""
        assert self.swarm is not None and self.server is not None
        while not await self.supervisor.sleep_or_stop(self.settings.service.announce_interval_s):
            try:
                bans = await self.swarm.read_bans()
            except (OSError, EOFError, P2PError) as exc:
                logger.debug("ban lookup failed: %s", exc)
                continue
            self.server.bans.set_dynamic(set(bans))

    def _feed(self) -> int:
        """Blocking: offer every pending inbox file to the buffer; returns how many were taken in."""
        taken = 0
        for path in self.inbox.pending():
            record = self.inbox.read(path)
            if record is None:
                self.metrics.files.labels("unreadable").inc()
                continue
            try:
                report = self.buffer.add(record, self.learner.step)
                if report.accepted:
                    self._rollout_rewards.extend(s.task_reward for s in record.samples)
            except TrainerError as exc:  # e.g. a policy step the trainer never published: refuse the file
                logger.error("refusing accepted file %s: %s", path.name, exc)
                self.inbox.mark_done(path)
                self.metrics.files.labels("unreadable").inc()
                continue
            if not report.accepted:  # the buffer is full: leave the rest on disk for later
                self.metrics.files.labels("deferred").inc()
                break
            self.inbox.mark_done(path)
            self.metrics.files.labels("used").inc()
            taken += 1
        self.metrics.buffered.set(self.buffer.buffered_samples)
        return taken

    def _train_step(self, batch: Batch) -> StepRecord:
        """Blocking: train, save, publish; commit the batch only once its checkpoint is published."""
        try:
            report = self.learner.train(batch)
        except BaseException:
            self.buffer.release(batch)
            raise
        with self.metrics.publish_seconds.time():
            self.learner.save_and_publish(self.settings.service.keep_states, self.settings.serve.keep)
        self.buffer.commit(batch)
        self.metrics.tokens.inc(report.tokens)
        values = {**batch.reward_metrics(), **report.summary()}
        if self._rollout_rewards:
            values["rollout_reward"] = sum(self._rollout_rewards) / len(self._rollout_rewards)
            self._rollout_rewards.clear()
        used = tuple(f"{g.file_id}:{g.prompt_key}" for g in batch.groups)
        return StepRecord(step=self.learner.step, values=values, wall_s=0.0, groups_used=used)

    async def _loop(self) -> None:
        svc = self.settings.service
        loop = asyncio.get_running_loop()
        waiting_since = loop.time()  # for the batch-wait histogram
        while not self.supervisor.stopping:
            if svc.max_steps is not None and self.learner.step >= svc.max_steps:
                self.supervisor.request_stop(f"reached policy step {self.learner.step} (max_steps)")
                return
            await self._blocking(self._feed)
            batch = await self._blocking(self.buffer.take, self.learner.step)
            if batch is None:
                await self.supervisor.sleep_or_stop(svc.poll_interval_s)
                continue
            started = loop.time()
            self.metrics.batch_wait_seconds.observe(started - waiting_since)
            record = await self._blocking(self._train_step, batch)
            record = StepRecord(record.step, record.values, loop.time() - started, record.groups_used)
            if self.server is not None:
                await self.server.rescan()  # serve the new version before announcing it, not at the next scan
            await self._announce()
            await self._blocking(self.log.append, record)
            self.metrics.observe(record)
            waiting_since = loop.time()
            logger.debug("%s", progress_line(record))
            if self.on_step is not None:
                self.on_step(record)
