"""The validator service: receive rollout files from the swarm, verify them, record and publish verdicts.

Flow of one file (docs/validator.md):
  hand-off header -> admit (not banned in the ledger; the batch the header signs is assigned to this
  validator, trainer/validator/assignment.py, else busy at the price of a rate token; then
  trainer/validator/admission.py: the node's tier, queue bounds, token bucket; "busy" here is the
  back-pressure and costs the sender nothing but a retry)
  -> body stored by the hand-off ->
  accept (fsync into the spool, queue) -> receipt to the sender -> fair queue -> verification thread
  (proofs/ checks, cheapest first; samples already accepted are a `duplicate`) -> signed verdict in the
  ledger (once per file hash and sender; an acceptance records its sample identities in the same
  transaction, and loses to any earlier claim on them) with its slashes and bans -> bans published in the
  DHT -> accepted files copied into the trainer's inbox -> spool entry removed. A file whose checkpoint the
  validator does not hold waits (held) until it is fetched, or is rejected when `hold_timeout_s` passes;
  a claimed step the run did not announce is the sender's fault, before the hold or at its end
  (trainer/validator/policy_steps.py). After a crash every spooled file is recovered and gets exactly one
  verdict: the ledger is idempotent on (file hash, sender) and every later step is idempotent too.

A delivery is (file hash, sender) throughout (`DeliveryKey`: spool entry, queue place, hold, ledger row, inbox
name): a node that re-signs another's file and delivers it first gets its own verdict (`signer`), and the
other's delivery of the same bytes is judged on its own.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass

from ...node.environments import Environment
from ...node.errors import PromptError
from ...node.run.settings import verifier_for_run
from ...p2p.errors import P2PError
from ...p2p.identity import Identity
from ...p2p.swarm import Admitted, HandoffBusy, HandoffRefused, ReceivedRollout, RolloutEnvelope, Swarm
from ...p2p.swarm.handoff import DeliveryKey, RolloutReceiver, body_deadline_s
from ...p2p.verdicts import Signed, Verdict, sign
from ...p2p.weights.store import Store
from ...proofs.pipeline.stage_file import read_stage_file
from ...proofs.rollout_schema import RolloutFileError
from ..ledger import AsyncLedger, BanEntry, DuplicateWork, Ledger
from .admission import Admission
from .assignment import AssignmentGate
from .bans import BanPublisher
from .checkpoints import CheckpointKeeper
from .config import ValidatorSettings
from .formed_groups import FormedGroups, FormedSettings, why_not_formed
from .group_job import Delivery, GroupOutcome, claimed_group, read_delivery, verify_group_files
from .groups import GroupIntake, GroupKey, PendingGroup
from .intake import Tier, TieredQueue
from .metrics import ValidatorMetrics
from .policy_steps import POLICY_STEP, PolicySteps
from .spool import Spool, SpooledFile, deliver
from .verify_job import DUPLICATE, Outcome, check_name, verify_spooled

logger = logging.getLogger(__name__)

MAX_ACCUSED_KEPT = 65536  # (accused, group, batch) keys remembered so that one batch's fraud is charged once
INTERNAL_ERROR = "internal_error"  # the validator failed, not the file: excused by the slashing policy
# A pipelined group no operator-signed group record formed: excused (its members' own signed work), not credited.
UNFORMED = "pipeline_unformed"
MAX_SIG_READ = 4096
GROUP_RECORDS_FILE = "group-records.json"  # the operator-signed group records seen (formed_groups.py)
MAX_UNFORMED_WAITING = 32  # per sender: group files waiting for a group record the validator does not know


@dataclass
class Job:
    entry: SpooledFile
    node_id: str  # the sender (the envelope's signer): with the file hash, what the verdict belongs to
    received_at: float
    tier: Tier = Tier.NEWCOMER  # the queue tier it was admitted to (trainer/validator/intake.py)
    step: int | None = None  # known once verification found the file's checkpoint missing
    hold_until: float = 0.0
    group: GroupKey | None = None  # a pipelined group's file: judged with its group (groups.py), not queued
    kind: str = (
        "stage"  # of a group's file: a member's stage file, or fraud evidence (its v3 envelope's kind)
    )
    # Of a group's file that parsed at arrival: (group id, members in stage order, policy step, batch) it names.
    claim: tuple[str, tuple[str, ...], int, int] | None = None

    @property
    def key(self) -> DeliveryKey:
        return DeliveryKey(self.entry.sha256, self.node_id)


class ValidatorService:
    """Owns the ledger, spool, queue and checkpoint keeper; the swarm is joined by the caller."""

    def __init__(
        self,
        settings: ValidatorSettings,
        identity: Identity,
        swarm: Swarm,
        environment: Environment | None = None,
    ) -> None:
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
            environment=environment,
        )
        self.keeper.on_version(self._release)
        self.steps = PolicySteps(
            self._announced_now,
            self._announced_seen,
            margin=settings.intake.step_margin,
        )
        self.verifier = verifier_for_run(settings.verifier, settings.run)
        # A hand-off may wait for a receive slot, then stream its body at the rate floor: its reservation
        # outlives the longest it may take. One that ends without a file frees its place at once (admit's
        # `abandon`); the lapse only covers a handler that vanished without that.
        sw = settings.swarm
        longest_body_s = body_deadline_s(sw, sw.max_rollout_bytes)
        self.admission = Admission(
            settings.intake, reservation_s=2 * sw.handoff_timeout_s + sw.handoff_slot_wait_s + longest_body_s
        )
        # (accused, group, batch) of upheld fraud evidence already recorded: a later report on the same batch (it
        # forms a new group entry once the first was judged) does not slash the accused again. Bounded, oldest out.
        self.accused: collections.OrderedDict[tuple[str, str, int], None] = collections.OrderedDict()
        # Only batches assigned to this validator get past admit; a misrouted header spends a rate token.
        self.assignment = AssignmentGate(swarm, self.admission.limiter)
        self.queue: TieredQueue[Job] = TieredQueue(settings.intake.newcomer_share)
        self.held: dict[DeliveryKey, Job] = {}  # jobs waiting for their checkpoint
        # Pipeline stage files wait here for their group (trainer/validator/groups.py); only in a run with a
        # stage layout. One verification runs at a time, a file's or a group's (both are torch-heavy).
        layout = settings.run.pipeline
        self.groups: GroupIntake[Job] | None = (
            GroupIntake(
                layout.stages,
                settings.intake.group_grace_s,
                settings.intake.hold_timeout_s,
                settings.intake.max_pending_groups,
            )
            if layout is not None
            else None
        )
        # The groups the operator's coordinator formed (operator-signed records, read through the swarm, which
        # opens only records a pinned operator key signed): a group's files are admitted only if one formed it.
        # They are kept on disk (re-opened, signatures checked, at start), so that a file spooled before a restart
        # still finds a record that has left the DHT since.
        self.formed = FormedGroups(
            swarm.read_group_records,
            settings.run.run_id,
            FormedSettings(settings.intake.group_records_keep_s, settings.intake.group_records_refresh_s),
            operator_keys=frozenset(operators),
            path=data / GROUP_RECORDS_FILE,
        )
        # Per sender, its group files waiting for a record that is not known yet: a made-up group's files cost
        # nothing but their wait, so one sender may not keep more than MAX_UNFORMED_WAITING of them waiting.
        self.unformed_waiting: collections.Counter[str] = collections.Counter()
        self._waiting_for_record: set[DeliveryKey] = set()  # the files `unformed_waiting` counts
        self.arrived = asyncio.Event()  # a group file arrived, or a group record was learned: check arrivals
        self.verifying = asyncio.Lock()
        self.bans = BanPublisher(
            self.ledger,
            swarm,
            identity,
            record_ttl_s=settings.swarm.ban_ttl_s,
            republish_s=settings.validator.ban_republish_s,
        )
        self.verdicts = 0  # decided by this process (tests and the benchmark read it)
        self.receiver: RolloutReceiver | None = None  # set once the swarm serves hand-offs (validator_run.py)
        self.metrics = ValidatorMetrics()  # served at /metrics (trainer/validator/run.py)
        self.metrics.watch(
            queue=lambda: len(self.queue),
            held=lambda: len(self.held),
            slots_in_use=lambda: self.receiver.slots.in_use if self.receiver is not None else 0,
            slots=lambda: self.receiver.slots.total if self.receiver is not None else 0,
        )

    # ----- intake ----------------------------------------------------------------------------------------

    async def admit(self, header: RolloutEnvelope) -> Admitted:
        """Before the body is read: refuse banned nodes; ask nodes over their bounds or rate to come back.

        The answer's tier decides which receive slots the body may use (p2p/swarm/slots.py); a hand-off that
        ends without a file (cut off, broken, wrong hash) frees its queue place at once.
        """
        if await self.ledger.active_ban(header.node_id) is not None:
            raise HandoffRefused("the sending node is banned by this validator")
        group = _group_key(header)
        if group is not None:
            if self.groups is None:
                raise HandoffRefused("a pipeline stage's file, but this run announces no stage layout")
            if self.groups.full(group):
                raise HandoffBusy(
                    f"{len(self.groups)} pipelined groups are collecting their stage files here",
                    self.settings.intake.busy_retry_s,
                )
            if (
                self.formed.find(group.group) is None
                and self.unformed_waiting[header.node_id] >= MAX_UNFORMED_WAITING
            ):
                raise HandoffBusy(
                    f"{MAX_UNFORMED_WAITING} of this node's group files already wait for a group record "
                    "this validator does not know",
                    self.settings.intake.busy_retry_s,
                )
        await self.assignment.check(header)  # another validator's batch is never read here (assignment.py)
        key = DeliveryKey(header.sha256, header.node_id)
        busy = self.admission.admit(key)
        if busy is not None:
            raise HandoffBusy(busy.reason, busy.retry_after_s)
        established = self.admission.tier_of(header.node_id) is Tier.ESTABLISHED
        return Admitted(established, abandon=lambda: self.admission.cancel(key))

    async def load_tiers(self) -> None:
        """Which nodes are established, from the files the ledger accepted recently (at start)."""
        rows = await self.ledger.query(
            "SELECT node_id, decided_at, COALESCE(credit_share, 1) AS share FROM contributions"
            " WHERE accepted = 1 AND decided_at >= ? ORDER BY decided_at",
            (self.admission.standing_since(),),
        )
        self.admission.load_accepted((r["node_id"], r["decided_at"], r["share"]) for r in rows)

    async def accept(self, received: ReceivedRollout) -> None:
        """The file is stored and its hash checked: make it durable before the receipt goes out."""
        key = received.key
        # A resend by the same sender: acknowledged, credited once. Another sender's verdict on the same bytes
        # says nothing about this delivery.
        if await self.ledger.verdict_for(*key) is not None:
            self.admission.cancel(key)
            await asyncio.to_thread(self.spool.remove, self.spool.entry(*key))
            return
        entry = await asyncio.to_thread(self.spool.make_durable, *key)
        envelope = received.envelope
        self._enqueue(
            Job(entry, key.node_id, time.time(), group=_group_key(envelope), kind=envelope.kind or "stage")
        )
        self.metrics.received.inc()

    def _enqueue(self, job: Job) -> None:
        job.tier = self.admission.enqueued(job.key)
        if job.group is not None and self.groups is not None:
            # Checked before it joins its group (`_arrival`, in the arrivals task, which this wakes).
            self.groups.arrive(job.group, job, job.received_at)
            self.arrived.set()
            return
        self.queue.put(job.tier, job.node_id, job)

    # ----- announced steps -------------------------------------------------------------------------------

    async def _announced_now(self) -> int | None:
        policy = await self.swarm.current_policy()
        return policy.step if policy is not None else None

    def _announced_seen(self) -> int | None:
        # What the policy watch has seen, and the newest version ever fetched (kept across restarts): only
        # announced versions are fetched.
        latest = self.keeper.latest_policy
        seen = max(-1 if latest is None else latest, self.keeper.store.high_water())
        return seen if seen >= 0 else None

    async def recover(self) -> int:
        """Queue every spooled file left by an earlier run; finish those already decided."""
        await self.load_tiers()  # recovered files join their node's tier
        if self.groups is not None:
            kept = await asyncio.to_thread(self.formed.load)
            if kept:
                logger.info("%d operator-signed group records kept from an earlier run", kept)
        recovered_at = time.time()
        entries = await asyncio.to_thread(self.spool.recover)
        for entry in entries:
            try:
                raw = await asyncio.to_thread(entry.sig_path.read_bytes)
                envelope = RolloutEnvelope.model_validate_json(raw[:MAX_SIG_READ])
                if envelope.sha256 != entry.sha256 or entry.node_id not in (None, envelope.node_id):
                    raise ValueError("it names another file or sender than the spool entry")
            except (OSError, ValueError) as exc:
                logger.warning(
                    "spooled file %s has an unreadable signature (%s); removing it", entry.path, exc
                )
                await asyncio.to_thread(self.spool.remove, entry)
                continue
            entry = dataclasses.replace(entry, node_id=envelope.node_id)  # a legacy entry learns its sender
            signed = await self.ledger.verdict_for(entry.sha256, envelope.node_id)
            group = _group_key(envelope)
            if signed is not None:  # decided before the crash: only delivery and removal may be missing
                to_trainer = group is None or (
                    signed.document.accepted
                    and envelope.kind == "stage"
                    and await asyncio.to_thread(self._last_stage, entry)
                )
                await self._finish(entry, signed, to_trainer=to_trainer)
                continue
            # A group file's arrival starts its grace period and its wait for its group's record: counted from now,
            # as the validator could not look for either while it was down.
            job = Job(
                entry,
                envelope.node_id,
                entry.path.stat().st_mtime if group is None else recovered_at,
                group=group,
                kind=envelope.kind or "stage",
            )
            if group is not None and self.groups is None:  # the run lost its layout: not the sender's doing
                reason = "a pipeline stage's file, but this run announces no stage layout any more"
                await self._decide(job, Outcome(False, group.policy_step, False, INTERNAL_ERROR, reason))
                continue
            self._enqueue(job)
        if entries:
            logger.info("recovered %d spooled files", len(entries))
        return len(entries)

    # ----- verification ---------------------------------------------------------------------------------

    async def run_worker(self, run_confirmed: asyncio.Event | None = None) -> None:
        """Verify queued files one at a time, in a worker thread (torch and parquet block), once
        `run_confirmed` is set (trainer/validator/run_confirmation.py: files wait until then)."""
        if run_confirmed is not None:
            await run_confirmed.wait()
        while True:
            job = await self.queue.get()
            if await self.ledger.active_ban(job.node_id) is not None:
                await self._decide(
                    job,
                    Outcome(
                        False,
                        job.step or 0,
                        False,
                        "banned",
                        "the sending node was banned before this file was verified",
                    ),
                )
                continue
            started = time.monotonic()
            try:
                async with self.verifying:
                    outcome = await asyncio.to_thread(
                        verify_spooled,
                        job.entry.path,
                        self.keeper.model_for,
                        self.verifier,
                        accepted=self.ledger.ledger.accepted_holder,
                    )
            except PromptError:
                # The run's prompts cannot be built with its model (docs/model.md, "Prompts"): no file can be
                # judged, so the validator stops and says why rather than excusing every file as its own failure.
                raise
            except Exception as exc:  # noqa: BLE001 - one file's judgement must never end the worker
                # Our failure (a checkpoint that will not load, a full disk, memory, a bug): never the sender's, so
                # excused. Every fault a file can be blamed for is a failed check inside verify_spooled; what
                # escapes it is the validator's, and stopping here would leave every later file unjudged.
                logger.exception("could not verify %s", job.entry.path)
                reason = f"the validator failed: {exc!r}"
                outcome = Outcome(False, job.step or 0, False, INTERNAL_ERROR, reason)
            if outcome.hold:
                await self._hold(job, outcome.step)
            else:
                self.metrics.verification_seconds.observe(time.monotonic() - started)
                await self._decide(job, outcome)

    async def _hold(self, job: Job, step: int) -> None:
        fault = await self.steps.refusal(step)
        if fault is not None:  # a wait for a checkpoint the run has not announced and will not soon
            await self._decide(job, Outcome(False, max(0, step), False, POLICY_STEP, fault))
            return
        if self.keeper.gone(step):
            held = self.keeper.held()
            await self._decide(
                job,
                Outcome(
                    False,
                    max(0, step),
                    False,
                    "checkpoint_unavailable",
                    f"checkpoint step {step} is no longer kept (held: {held})",
                ),
            )
            return
        job.step = step
        job.hold_until = job.received_at + self.settings.intake.hold_timeout_s
        self.held[job.key] = job
        logger.info("holding %s until checkpoint step %d arrives", job.entry.sha256[:16], step)

    def _release(self, step: int) -> None:
        for key, job in list(self.held.items()):
            if job.step == step:
                del self.held[key]
                self.queue.put(job.tier, job.node_id, job, front=True)

    async def run_holds(self) -> None:
        """Reject held files whose checkpoint did not arrive within hold_timeout_s: excused when the step was
        announced (the validator could not get it), the sender's fault when it never was."""
        timeout = self.settings.intake.hold_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.time()
            for key, job in list(self.held.items()):
                if job.hold_until <= now and self.held.pop(key, None) is not None:
                    assert job.step is not None
                    fault = await self.steps.never_announced(job.step)
                    if fault is not None:
                        outcome = Outcome(False, max(0, job.step), False, POLICY_STEP, fault)
                    else:
                        outcome = Outcome(
                            False,
                            max(0, job.step),
                            False,
                            "checkpoint_unavailable",
                            f"no checkpoint for step {job.step} arrived within {timeout:g} s "
                            f"(held steps: {self.keeper.held()}); the file expired unverified",
                        )
                    await self._decide(job, outcome)

    # ----- pipelined groups ------------------------------------------------------------------------------

    async def run_groups(self, run_confirmed: asyncio.Event | None = None) -> None:
        """Judge pipelined groups as their stage files complete them or their grace period ends (groups.py).

        A file still being checked (`run_arrivals`) keeps its group open past the grace period (groups.py `due`)."""
        if self.groups is None:
            return
        if run_confirmed is not None:
            await run_confirmed.wait()
        tick = min(1.0, self.settings.intake.group_grace_s / 4)
        while True:
            await asyncio.sleep(tick)
            for group, complete in self.groups.due(time.time()):
                await self._judge_group(group, complete)

    async def run_arrivals(self, run_confirmed: asyncio.Event | None = None) -> None:
        """Check each arrived group file as it comes (`_arrival`), apart from the judging: a group's judgement (a
        prefill, seconds) never delays its members' files joining their groups."""
        if self.groups is None:
            return
        if run_confirmed is not None:
            await run_confirmed.wait()
        tick = min(1.0, self.settings.intake.group_grace_s / 4)
        while True:
            try:  # woken by an arrival or a learned record; else each tick, for files whose grace runs out
                async with asyncio.timeout(tick):
                    await self.arrived.wait()
            except TimeoutError:
                pass
            self.arrived.clear()
            for job in self.groups.take_arrivals():
                if not await self._arrival(job):
                    self.groups.retry(job)

    async def run_group_records(self) -> None:
        """Read the operator's group records from the DHT while a file waits for its group's record, at most once
        per `group_records_refresh_s` (formed_groups.py); a failed read is logged and tried again."""
        if self.groups is None:
            return
        while True:
            await asyncio.sleep(self.settings.intake.group_records_refresh_s)
            if not self.unformed_waiting and not self.formed.should_save(learned=False):
                continue
            learned = False
            if self.unformed_waiting and self.formed.may_read():
                try:
                    learned = await self.formed.refresh()
                except (OSError, EOFError, P2PError) as exc:
                    logger.warning("could not read group records (the files wait for the next read): %s", exc)
                self.arrived.set()  # a found record admits its files; a read that answered may end waits
            if self.formed.should_save(learned):
                try:
                    await asyncio.to_thread(self.formed.write, self.formed.snapshot())
                except OSError as exc:
                    logger.warning("could not keep the group records on disk: %s", exc)

    async def _arrival(self, job: Job) -> bool:
        """Admit an arrived file to its group, or decide it; False while it waits for its group's record.

        Cheapest first: a sender its group's known record does not name is refused before its file is read
        (`signer`, its fault: its own envelope names a group it is not in); then the file must parse (signature,
        schema, limits, its signer a member of the group it names: a failure is its sender's, as for any malformed
        file), so that junk routed to a group's key starts no grace period. A file whose group's record is not
        known waits for the record until its own grace period ends (the records task re-reads the DHT meanwhile):
        a read that does not show it may have missed it. Then, with no record, `pipeline_unformed` (excused, not
        credited) when a read found the DHT's records since the file arrived, else `internal_error`."""
        assert self.groups is not None and self.settings.run.pipeline is not None and job.group is not None
        key = job.group
        record = self.formed.find(key.group)
        if record is not None and job.node_id not in record.members:
            reason = f"the sender is not a member of group {key.group[:16]}…, which its envelope names"
            await self._settle(job, Outcome(False, key.policy_step, False, "signer", reason))
            return True
        if job.claim is None:
            delivery = Delivery(job.entry.path, job.node_id, job.kind)
            try:
                parsed = await asyncio.to_thread(read_delivery, delivery, self.verifier.file_limits())
            except RolloutFileError as exc:
                outcome = Outcome(False, key.policy_step, False, check_name(exc.check), str(exc))
                await self._settle(job, outcome)
                return True
            except Exception as exc:  # noqa: BLE001 - one file must never end the task; ours, not the sender's
                logger.exception("could not read group file %s", job.entry.path)
                reason = f"the validator failed: {exc!r}"
                await self._settle(job, Outcome(False, key.policy_step, False, INTERNAL_ERROR, reason))
                return True
            job.claim = claimed_group(parsed)
        gid, members, step, batch = job.claim
        if (gid, step, batch) != tuple(key):
            # The readers check that the file names the group and batch its envelope signs, and the key came from
            # that envelope: a mismatch is the validator's bug, never the sender's doing.
            reason = "the file names another group or batch than the key it was collected under"
            await self._settle(job, Outcome(False, step, False, INTERNAL_ERROR, reason))
            return True
        record = self.formed.find(gid)  # a read may have learned it while the file was read
        if record is None:
            waiting = time.time() - job.received_at < self.settings.intake.group_grace_s
            if waiting:
                if job.key not in self._waiting_for_record:
                    self._waiting_for_record.add(job.key)
                    self.unformed_waiting[job.node_id] += 1
                return False
            if not self.formed.answered_since(job.received_at):
                reason = (
                    "the validator could not read the operator's group records from the DHT within the file's "
                    "grace period"
                )
                await self._settle(job, Outcome(False, step, False, INTERNAL_ERROR, reason))
                return True
        why = why_not_formed(record, members, step, self.settings.run.pipeline)
        if why is not None:
            await self._settle(job, Outcome(False, step, False, UNFORMED, f"group {gid[:16]}…: {why}"))
            return True
        self._stop_waiting(job)
        self.groups.add(key, job, job.received_at, urgent=job.kind == "fraud")
        self.groups.settle(key, job.received_at)
        return True

    def _stop_waiting(self, job: Job) -> None:
        if job.key in self._waiting_for_record:
            self._waiting_for_record.discard(job.key)
            self.unformed_waiting[job.node_id] -= 1
            if self.unformed_waiting[job.node_id] <= 0:
                del self.unformed_waiting[job.node_id]

    async def _settle(self, job: Job, outcome: Outcome) -> None:
        """Decide an arrived group file on its own (it joins no group)."""
        assert self.groups is not None and job.group is not None
        self._stop_waiting(job)
        self.groups.settle(job.group, job.received_at)
        await self._decide(job, outcome)

    async def _judge_group(self, group: PendingGroup[Job], complete: bool) -> None:
        assert self.groups is not None and self.settings.run.pipeline is not None
        step = group.key.policy_step
        if group.holding and not self.groups.hold_expired(group, time.time()):
            if step not in await asyncio.to_thread(self.keeper.store.versions):
                return
        deliveries = [Delivery(job.entry.path, job.node_id, job.kind) for job in group.jobs]
        started = time.monotonic()
        try:
            async with self.verifying:
                result = await asyncio.to_thread(
                    verify_group_files,
                    deliveries,
                    self.settings.run,
                    self.settings.run.pipeline,
                    self.keeper.model_for,
                    complete=complete,
                    limits=self.verifier.file_limits(),
                )
        except PromptError:
            raise  # the run's prompts cannot be built with its model: no file can be judged (run_worker)
        except Exception as exc:  # noqa: BLE001 - one group's judgement must never end the task
            logger.exception("could not verify group %s", group.key.group[:16])
            reason = f"the validator failed: {exc!r}"
            result = GroupOutcome(
                step=step,
                outcomes={
                    d: Outcome(False, step, False, INTERNAL_ERROR, reason) for d in range(len(deliveries))
                },
            )
        if result.hold:
            # As for a rollout file (`_hold`): a step far beyond the newest announced one is refused at once, so a
            # made-up step cannot hold a group slot (of `max_pending_groups`) for the whole hold timeout.
            fault = await self.steps.refusal(step)
            if fault is None and not self.groups.hold_expired(group, time.time()):
                group.holding = True
                return
            if fault is None:
                fault = await self.steps.never_announced(step)
            for d in range(len(deliveries)):
                result.outcomes.setdefault(
                    d,
                    Outcome(False, step, False, POLICY_STEP, fault)
                    if fault is not None
                    else Outcome(
                        False,
                        step,
                        False,
                        "checkpoint_unavailable",
                        f"no checkpoint for step {step} arrived in time; the group expired unverified",
                    ),
                )
        if len(result.outcomes) < len(
            deliveries
        ):  # an early try without every stage: wait for more or the grace
            group.tried_with = len(group.jobs)
            return
        self.groups.done(group.key)
        seconds = time.monotonic() - started
        for d, job in enumerate(group.jobs):
            self.metrics.verification_seconds.observe(seconds / len(group.jobs))
            await self._decide(job, result.outcomes[d])
        for accusation in result.accusations:  # the accused of upheld fraud evidence: a verdict on the report
            if accusation.key in self.accused:
                continue
            self.accused[accusation.key] = None
            while len(self.accused) > MAX_ACCUSED_KEPT:
                self.accused.popitem(last=False)
            signed = self._verdict(accusation.file_hash, accusation.node_id, accusation.outcome)
            recorded = await self.ledger.record(signed, received_at=group.first_at)
            self.verdicts += 0 if recorded.duplicate else 1
            for ban in recorded.new_bans:
                await self.publish_ban(ban)
            logger.warning(
                "node %s blamed by its receiver's evidence: %s",
                accusation.node_id[:16],
                signed.document.reason[:200],
            )

    # ----- verdicts ---------------------------------------------------------------------------------------

    def _verdict(self, file_hash: str, node_id: str, outcome: Outcome) -> Signed[Verdict]:
        verdict = Verdict.outgoing(
            file_hash=file_hash,
            node_id=node_id,
            step=max(0, min(outcome.step, 2**62)),
            samples=outcome.samples if outcome.accepted else 0,
            tokens=outcome.tokens if outcome.accepted else 0,
            accepted=outcome.accepted,
            failed_check=outcome.failed_check,
            reason=outcome.reason,  # made printable and cut by `outgoing`: readers refuse control characters
            validator_id=self.identity.node_id,
            decided_at=time.time(),
        )
        return sign(verdict, self.identity)

    async def _decide(self, job: Job, outcome: Outcome) -> None:
        try:
            result = await self.ledger.record(
                self._verdict(job.entry.sha256, job.node_id, outcome),
                received_at=job.received_at,
                task_reward_sum=outcome.task_reward_sum if outcome.accepted else None,
                samples=outcome.sample_ids if outcome.accepted else (),
                credit_share=outcome.credit_share,
            )
        except DuplicateWork as exc:
            # Another file claimed one of these samples after this one's early check (a race the ledger's key
            # settles): the acceptance was not written; the file is a duplicate after all.
            outcome = dataclasses.replace(
                outcome, accepted=False, failed_check=DUPLICATE, reason=str(exc), sample_ids=()
            )
            result = await self.ledger.record(
                self._verdict(job.entry.sha256, job.node_id, outcome), received_at=job.received_at
            )
        self.verdicts += 0 if result.duplicate else 1
        if not result.duplicate:
            signed = result.verdict.document
            self.metrics.verdict(signed.accepted, signed.failed_check, signed.decided_at - job.received_at)
            self.metrics.bans.inc(len(result.new_bans))
        if outcome.accepted and not result.duplicate:
            # Its next file may count as established: a stage file counts its share of the batch, as its credit.
            self.admission.note_accepted(job.node_id, share=outcome.credit_share)
        level = logging.INFO if outcome.accepted else logging.WARNING
        logger.log(
            level,
            "file %s from %s: %s",
            job.entry.sha256[:16],
            job.node_id[:16],
            "accepted" if outcome.accepted else f"rejected ({outcome.reason[:200]})",
        )
        for ban in result.new_bans:
            await self.publish_ban(ban)
        await self._finish(job.entry, result.verdict, to_trainer=outcome.to_trainer)
        self.admission.finished(job.key)

    def _last_stage(self, entry: SpooledFile) -> bool:
        """Whether an accepted stage file is its group's last stage's (recovery: its outcome is gone). Blocking."""
        try:
            return read_stage_file(entry.path, self.verifier.file_limits()).last
        except RolloutFileError as exc:  # it was accepted, so it read before: the spool entry is damaged
            logger.warning("accepted stage file %s no longer reads (%s); not delivered", entry.path, exc)
            return False

    async def _finish(self, entry: SpooledFile, signed: Signed[Verdict], *, to_trainer: bool = True) -> None:
        # A rollout file, or the last stage's file of an accepted group (`Outcome.to_trainer`): the trainer trains
        # on its rows. The other stages' files hold the same samples under their own node ids: credited only.
        if signed.document.accepted and to_trainer:
            await asyncio.to_thread(deliver, entry, self.accepted_dir)
        await asyncio.to_thread(self.spool.remove, entry)

    async def publish_ban(self, ban: BanEntry) -> None:
        """Publish a new ban in the DHT now (operator-signed, its TTL following the ban's length).

        The publisher's loop (`bans.run`, trainer/validator/bans.py) keeps it there while it is in force.
        """
        await self.bans.publish(ban)


def _group_key(envelope: RolloutEnvelope) -> GroupKey | None:
    """The group batch a stage file's (v3) envelope signs; None for a rollout file's."""
    if envelope.group is None or envelope.batch is None:
        return None
    return GroupKey(envelope.group, *envelope.batch)
