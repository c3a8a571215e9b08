"""The validator service: receive rollout files from the swarm, verify them, record and publish verdicts.

Flow of one file (docs/validator.md):
  hand-off header -> admit (not banned in the ledger, the node's token bucket, queue bounds; refusing
  here is the back-pressure and costs the sender nothing but a retry) -> body stored by the hand-off ->
  accept (fsync into the spool, queue) -> receipt to the sender -> fair queue -> verification thread
  (proofs/ checks, cheapest first) -> signed verdict in the ledger (once per file hash) with its slashes
  and bans -> bans published in the DHT -> accepted files copied into the trainer's inbox -> spool entry
  removed. A file whose checkpoint the validator does not hold waits (held) until it is fetched, or is
  rejected when `hold_timeout_s` passes. After a crash every spooled file is recovered and gets exactly
  one verdict: the ledger is idempotent on the file hash and every later step is idempotent too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

from ..node.errors import NodeError
from ..p2p.errors import P2PError
from ..p2p.identity import Identity
from ..p2p.swarm import HandoffRefused, ReceivedRollout, RolloutEnvelope, Swarm
from ..p2p.weights.store import Store
from .checkpoints import CheckpointKeeper
from .errors import TrainerError
from .intake import FairQueue, RateLimiter
from .ledger import AsyncLedger, BanEntry, Ledger
from .spool import Spool, SpooledFile, deliver
from .validator_config import ValidatorSettings
from .verdicts import MAX_REASON_CHARS, Signed, Verdict, sign
from .verify_job import Outcome, verify_spooled

logger = logging.getLogger(__name__)

INTERNAL_ERROR = "internal_error"  # the validator failed, not the file: excused by the slashing policy
MAX_SIG_READ = 4096


@dataclass
class Job:
    entry: SpooledFile
    node_id: str
    received_at: float
    step: int | None = None  # known once verification found the file's checkpoint missing
    hold_until: float = 0.0


class ValidatorService:
    """Owns the ledger, spool, queue and checkpoint keeper; the swarm is joined by the caller."""

    def __init__(self, settings: ValidatorSettings, identity: Identity, swarm: Swarm) -> None:
        self.settings = settings
        self.identity = identity
        self.swarm = swarm
        data = settings.resolved_data_dir()
        ledger_path = settings.ledger.path
        if not ledger_path.is_absolute():
            ledger_path = data / ledger_path
        self.ledger = AsyncLedger(Ledger(ledger_path, settings.slashing, settings=settings.ledger))
        self.spool = Spool(settings.path(settings.validator.spool_dir, "spool"))
        self.accepted_dir = settings.path(settings.validator.accepted_dir, "accepted")
        operators = settings.swarm.operator_keys
        self.keeper = CheckpointKeeper(
            Store(settings.path(settings.validator.weights_dir, "validator-weights")),
            settings.validator.weights_key or operators[0],
            settings.run,
            settings.engine,
            keep=settings.validator.keep_checkpoints,
            fetch=settings.fetch.model_copy(update={"keep": settings.validator.keep_checkpoints}),
            identity=identity,
        )
        self.keeper.on_version(self._release)
        self.verifier = settings.verifier.model_copy(
            update={"run_id": settings.run.run_id, "run_seed": settings.run.run_seed,
                    "samples_per_prompt": settings.run.samples}
        )
        intake = settings.intake
        self.limiter = RateLimiter(intake.rate_per_minute, intake.burst)
        self.queue: FairQueue[Job] = FairQueue()
        self.held: dict[str, Job] = {}
        self.outstanding: Counter[str] = Counter()  # files per node between receipt and verdict
        self._known: set[str] = set()  # hashes between receipt and verdict
        self.verdicts = 0  # decided by this process (tests and the benchmark read it)

    # ----- intake ----------------------------------------------------------------------------------------

    async def admit(self, header: RolloutEnvelope) -> None:
        """Before the body is read: refuse banned nodes, nodes over their rate, and a full queue."""
        if await self.ledger.active_ban(header.node_id) is not None:
            raise HandoffRefused("the sending node is banned by this validator")
        intake = self.settings.intake
        if sum(self.outstanding.values()) >= intake.queue_size:
            raise HandoffRefused(f"the validator's queue is full ({intake.queue_size} files); retry later")
        if self.outstanding[header.node_id] >= intake.per_node_queue:
            raise HandoffRefused(
                f"this node already has {intake.per_node_queue} files waiting for verification; retry later"
            )
        wait = self.limiter.try_take(header.node_id)
        if wait > 0:
            raise HandoffRefused(
                f"rate limit: {intake.rate_per_minute:g} files per minute; retry in {wait:.1f} s"
            )

    async def accept(self, received: ReceivedRollout) -> None:
        """The file is stored and its hash checked: make it durable before the receipt goes out."""
        sha = received.envelope.sha256
        if await self.ledger.verdict_for(sha) is not None:  # a resend: acknowledged, credited once
            await asyncio.to_thread(self.spool.remove, self.spool.entry(sha))
            return
        entry = await asyncio.to_thread(self.spool.make_durable, sha)
        self._enqueue(Job(entry, received.envelope.node_id, time.time()))

    def _enqueue(self, job: Job, *, front: bool = False) -> None:
        if job.entry.sha256 not in self._known:
            self._known.add(job.entry.sha256)
            self.outstanding[job.node_id] += 1
        self.queue.put(job.node_id, job, front=front)

    async def recover(self) -> int:
        """Queue every spooled file left by an earlier run; finish those already decided."""
        entries = await asyncio.to_thread(self.spool.recover)
        for entry in entries:
            signed = await self.ledger.verdict_for(entry.sha256)
            if signed is not None:  # decided before the crash: only delivery and removal may be missing
                await self._finish(entry, signed)
                continue
            try:
                raw = await asyncio.to_thread(entry.sig_path.read_bytes)
                envelope = RolloutEnvelope.model_validate_json(raw[:MAX_SIG_READ])
            except (OSError, ValueError) as exc:
                logger.warning("spooled file %s has an unreadable signature (%s); removing it",
                               entry.path, exc)
                await asyncio.to_thread(self.spool.remove, entry)
                continue
            self._enqueue(Job(entry, envelope.node_id, entry.path.stat().st_mtime))
        if entries:
            logger.info("recovered %d spooled files", len(entries))
        return len(entries)

    # ----- verification ---------------------------------------------------------------------------------

    async def run_worker(self) -> None:
        """Verify queued files one at a time, in a worker thread (torch and parquet block)."""
        while True:
            job = await self.queue.get()
            if await self.ledger.active_ban(job.node_id) is not None:
                await self._decide(job, Outcome(False, job.step or 0, False, "banned",
                                                "the sending node was banned before this file was verified"))
                continue
            try:
                outcome = await asyncio.to_thread(
                    verify_spooled, job.entry.path, self.keeper.model_for, self.verifier
                )
            except (NodeError, TrainerError, OSError, RuntimeError, ValueError) as exc:
                # Our failure (a checkpoint that will not load, a full disk, a bug): never the sender's.
                logger.exception("could not verify %s", job.entry.path)
                reason = f"the validator failed: {exc!r}"
                outcome = Outcome(False, job.step or 0, False, INTERNAL_ERROR, reason)
            if outcome.hold:
                await self._hold(job, outcome.step)
            else:
                await self._decide(job, outcome)

    async def _hold(self, job: Job, step: int) -> None:
        if self.keeper.gone(step):
            held = self.keeper.held()
            await self._decide(job, Outcome(False, max(0, step), False, "checkpoint_unavailable",
                                            f"checkpoint step {step} is no longer kept (held: {held})"))
            return
        job.step = step
        job.hold_until = job.received_at + self.settings.intake.hold_timeout_s
        self.held[job.entry.sha256] = job
        logger.info("holding %s until checkpoint step %d arrives", job.entry.sha256[:16], step)

    def _release(self, step: int) -> None:
        for sha, job in list(self.held.items()):
            if job.step == step:
                del self.held[sha]
                self.queue.put(job.node_id, job, front=True)

    async def run_holds(self) -> None:
        """Reject held files whose checkpoint did not arrive within hold_timeout_s."""
        timeout = self.settings.intake.hold_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.time()
            for sha, job in list(self.held.items()):
                if job.hold_until <= now and self.held.pop(sha, None) is not None:
                    assert job.step is not None
                    await self._decide(job, Outcome(
                        False, max(0, job.step), False, "checkpoint_unavailable",
                        f"no checkpoint for step {job.step} arrived within {timeout:g} s "
                        f"(held steps: {self.keeper.held()}); the file expired unverified",
                    ))

    # ----- verdicts ---------------------------------------------------------------------------------------

    async def _decide(self, job: Job, outcome: Outcome) -> None:
        verdict = Verdict(
            file_hash=job.entry.sha256,
            node_id=job.node_id,
            step=max(0, min(outcome.step, 2**62)),
            samples=outcome.samples if outcome.accepted else 0,
            tokens=outcome.tokens if outcome.accepted else 0,
            accepted=outcome.accepted,
            failed_check=outcome.failed_check,
            reason=outcome.reason[:MAX_REASON_CHARS],
            validator_id=self.identity.node_id,
            decided_at=time.time(),
        )
        result = await self.ledger.record(sign(verdict, self.identity), received_at=job.received_at)
        self.verdicts += 0 if result.duplicate else 1
        level = logging.INFO if outcome.accepted else logging.WARNING
        logger.log(level, "file %s from %s: %s", job.entry.sha256[:16], job.node_id[:16],
                   "accepted" if outcome.accepted else f"rejected ({outcome.reason[:200]})")
        for ban in result.new_bans:
            await self.publish_ban(ban)
        await self._finish(job.entry, result.verdict)
        self._known.discard(job.entry.sha256)
        self.outstanding[job.node_id] -= 1
        if self.outstanding[job.node_id] <= 0:
            del self.outstanding[job.node_id]

    async def _finish(self, entry: SpooledFile, signed: Signed[Verdict]) -> None:
        if signed.document.accepted:
            await asyncio.to_thread(deliver, entry, self.accepted_dir)
        await asyncio.to_thread(self.spool.remove, entry)

    async def publish_ban(self, ban: BanEntry) -> None:
        """Publish a ban in the DHT (operator-signed) and keep the signed ban document in the ledger."""
        try:
            await self.swarm.publish_ban(ban.node_id, ban.reason)
        except (P2PError, OSError, EOFError) as exc:  # DHT unreachable for now: the republish loop retries
            logger.warning("ban of %s not published yet: %s", ban.node_id[:16], exc)
            return
        if ban.record is None:
            record = sign(ban.to_record(self.identity.node_id), self.identity)
            await self.ledger.attach_ban_record(ban.id, record)
