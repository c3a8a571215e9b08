"""Runs this node's stage of the group its PipelineMember joined, batch after batch, with w3-pipe's StageRunner.

`on_change` (given to PipelineMember) is the only entry: leaving a group cancels the stage task, which
abandons the batch in flight (its runner's streams close; no stage record is made for a batch that did not
end, so nothing partial can be handed to a validator), and joining one starts a new named task. A batch that
fails (a peer gone, a frame late or malformed) is abandoned the same way; the task then waits `retry_s` and
starts the next batch number while the group stands, and the member's next poll dissolves it otherwise.

How a stage reaches its neighbours comes from its `Hops` (hops.py): `LoopbackHops` for stages in one process (the
tests and benchmarks), `SwarmHops` across nodes (libp2p streams to the peer id each member's signed heartbeat
names; only the predecessor the group record names may stream to a stage). Leaving a group forgets its hops.

What a member hands its validator comes out through two callbacks: `on_batch` for every batch that ended (its
stage record; on the last stage the completions and the final hidden states its rollout proofs commit to) and
`on_lost` for a batch that began and broke: with the fraud evidence when the predecessor sent a frame its
commitment belies, else with this stage's partial record (what it received and sent up to the break), which
the validator's blame_broken needs from every member to name a stage that broke the batch. A batch abandoned
because the node left its group (cancellation) produces neither.

Batch numbers come from `BatchMarks` (batch_marks.py): a stage task starts from the group's first unused number,
and each number is recorded durably before its opening is signed, so no opening is ever signed twice. A follower
takes its number from the route its predecessor dialled with, which nobody signed: it records it only after it
read the predecessor's signed opening of that very batch, and only when it lies at most `max_batch_jump` past its
mark (else a predecessor could move the mark to 2^63 - 1, past which no route decodes: the group dead for this
node, across restarts too). A group whose marks refuse it (batch_marks.py: its step is older than the marks keep,
or it was formed before the newest formation whose marks were dropped for room) is not run at all.

A group whose batches keep breaking is given up: after `leave_after_broken` batches in a row abandoned with
none finished between them once the ring had closed (every member took the batch: group.py `ring_closed`; a
neighbour that takes each batch and hangs up, or sends frames the schedule does not call for, again and
again), or once no batch finished for `leave_without_batch_s`, the stage task ends and `on_give_up` tells the
owner, which leaves the group and does not rejoin it (node/pipeline/member.py `avoid`): each broken batch can
make a file for the validator at every member, and the operator's coordinator keeps a group whose members all
stay live and confirm it. A batch that breaks before the ring closed is not counted: the leader's batch is in
flight from the start and a follower's once its predecessor's opening is read, so a member still loading its
stage, or holding back while its outbox is full, breaks one every `connect_timeout_s` without fault; the time
limit alone covers a member that never takes a batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ...p2p.identity import Identity
from ...p2p.pipeline.errors import PipelineWireError
from ...p2p.pipeline.group_ids import nonce_formed_ms
from ...p2p.pipeline.layout import StageLayout
from ...p2p.pipeline.transport import Inbound, Route
from ...p2p.swarm.group_records import GroupRecord
from ...proofs.errors import ProofError
from ...proofs.pipeline.records import GroupSpec, HopFraud, SignedStageRecord
from ..engine.types import Completion
from .batch_marks import BatchMarks
from .driver import Tamper, known_tokens, stage_record
from .errors import PipelineError
from .group import HopSettings, StageRunner
from .hops import Hops
from .stage import StageProcessor
from .stage_model import StageModel
from .work import PipelineWork

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
# How far past its mark a follower takes a batch number. The leader burns a number per failed attempt (about
# two a second at the default retry_s when its successor is down): 2^20 is days of that, while a predecessor
# pushing the mark by the most each batch would need 2^43 batches to reach the end of the range.
MAX_BATCH_JUMP = 1 << 20
ABANDONED_KEPT = 256  # the recent abandoned batches kept for the status API and the tests

# Called with the group this node gives up, why, and whether the group's batches failed (broke, or none finished:
# the owner names the group as left in its heartbeat, so the coordinator does not cool it down for leaving) rather
# than this node's own state (its batch marks). The stage task has ended; the owner leaves the group.
OnGiveUp = Callable[[GroupRecord, str, bool], None]


@dataclass(frozen=True)
class BatchDone:
    group: GroupRecord
    batch: int
    stage: int
    record: SignedStageRecord
    completions: list[Completion] | None  # the last stage's; None elsewhere
    # The last stage's, per sample: the final normed states that produced its tokens (its rollout proofs).
    final_states: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class BatchLost:
    """A batch that began (the predecessor's opening was read) and broke: what this member hands in for it."""

    group: GroupRecord
    batch: int
    stage: int
    why: str
    fraud: HopFraud | None  # the predecessor's frame its commitment belies: the evidence against it
    partial: SignedStageRecord | None  # otherwise this stage's record up to the break
    # The neighbour (node id) whose stream failed first, when that is known (group.py `StageRunner.broke`);
    # None when the batch broke otherwise (this stage's own computation: activations no commitment admits).
    broken_by: str | None = None


# The checkpoint directory of a policy step (a node holds several; a group is for one step).
CheckpointFor = Callable[[int], Path]
# How a stage's slice of the checkpoint is loaded (StageModel.load; the devnet's adversaries substitute one).
LoadStage = Callable[[Path, StageLayout, int], StageModel]


class StageHost:
    def __init__(
        self,
        identity: Identity,
        run_id: str,
        checkpoint: Path | CheckpointFor,
        layout: StageLayout,
        work_for: Callable[[GroupRecord, int], PipelineWork],
        hops: Hops,
        hop: HopSettings,
        on_batch: Callable[[BatchDone], Awaitable[None]],
        *,
        on_lost: Callable[[BatchLost], Awaitable[None]] | None = None,
        marks: BatchMarks | None = None,
        tamper: Tamper | None = None,
        load_stage: LoadStage = StageModel.load,
        retry_s: float = 0.5,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        max_batch_jump: int = MAX_BATCH_JUMP,
        leave_after_broken: int | None = None,
        leave_without_batch_s: float | None = None,
        on_give_up: OnGiveUp | None = None,
    ) -> None:
        self.identity, self.run_id, self.layout = identity, run_id, layout
        self.checkpoint: CheckpointFor = checkpoint if callable(checkpoint) else (lambda _step: checkpoint)
        self.work_for, self.hops, self.hop, self.on_batch = work_for, hops, hop, on_batch
        self.on_lost = on_lost
        self.marks = marks if marks is not None else BatchMarks(None)
        self.tamper = tamper  # fault injection (tests, the devnet's adversaries); None in production
        self.load_stage = load_stage
        self.retry_s, self.stop_timeout_s = retry_s, stop_timeout_s
        self.max_batch_jump = max_batch_jump
        self.leave_after_broken = leave_after_broken  # None: never give a group up for broken batches
        self.leave_without_batch_s = leave_without_batch_s  # None: never give a group up for want of batches
        self.on_give_up = on_give_up
        self.given_up: dict[str, str] = {}  # group id -> why, for the groups this host gave up (newest last)
        self.task: asyncio.Task[None] | None = None
        self.in_flight: tuple[str, int] | None = None  # (group id, batch) being generated now
        self.abandoned: deque[tuple[str, int, str]] = deque(maxlen=ABANDONED_KEPT)  # (group id, batch, why)
        self.abandoned_count = 0

    async def on_change(self, group: GroupRecord | None, why: str) -> None:
        await self.stop(why)
        if group is not None:
            self.task = asyncio.create_task(self._run(group), name=f"pipeline-stage-{group.group_id[:12]}")

    async def stop(self, why: str = "stopped") -> None:
        """Cancel the stage task and wait for it to end (PipelineError past `stop_timeout_s`: something in it
        swallowed the cancellation, a bug); a batch it had in flight is abandoned. An error the task raised
        other than its cancellation is raised here."""
        task, self.task = self.task, None  # from now on the task records nothing (see _run)
        if task is None:
            return
        # Cancel again every little while until the deadline: a cancellation that arrives as an inner wait
        # completes can be lost (asyncio.wait_for before 3.12, bpo-42130), and the task would run on.
        deadline = asyncio.get_running_loop().time() + self.stop_timeout_s
        while not task.done():
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            task.cancel()
            await asyncio.wait({task}, timeout=min(0.25, remaining))
        if not task.done():
            raise PipelineError(
                f"stage task {task.get_name()} ignored its cancellation for {self.stop_timeout_s:.1f} s"
            )
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
        if self.in_flight is not None:
            self._abandon(*self.in_flight, why)
            self.in_flight = None

    def _abandon(self, group_id: str, batch: int, why: str) -> None:
        self.abandoned.append((group_id, batch, why))
        self.abandoned_count += 1

    async def _run(self, group: GroupRecord) -> None:
        stage = group.stage_of(self.identity.node_id)
        if stage is None:
            raise PipelineError(f"group {group.group_id[:16]}… does not name this node")
        refused = await asyncio.to_thread(
            partial(self.marks.why_refused, formed_ms=nonce_formed_ms(group.nonce)),
            self.run_id,
            group.group_id,
            group.policy_step,
        )
        if refused is not None:
            self._give_up(group, f"its batch numbers cannot be kept: {refused}", batches_failed=False)
            return
        checkpoint = self.checkpoint(group.policy_step)
        model = await asyncio.to_thread(self.load_stage, checkpoint, self.layout, stage)
        try:
            await self._batches(group, stage, model)
        finally:
            self.hops.leave(group.group_id)

    async def _batches(self, group: GroupRecord, stage: int, model: StageModel) -> None:
        # Stage 0 leads: it numbers the batches, one after another, a failed one included. Every other stage
        # follows: it runs the batch its predecessor opens (the newest, if several wait), never one it already
        # ran. So members that start at different times or fail at different points fall back into step at
        # the next batch instead of each waiting for a batch number the others have left behind.
        stages = self.layout.stages
        previous, following = group.members[(stage - 1) % stages], (stage + 1) % stages
        leader = stage == 0
        step = group.policy_step
        formed_ms = nonce_formed_ms(group.nonce)  # orders formations: which marks go first (batch_marks.py)
        # never a number this node signed an opening for
        batch = self.marks.next_batch(self.run_id, group.group_id, step, formed_ms=formed_ms)
        broken = 0  # batches abandoned in a row after the ring closed, none finished between them
        progress_at = time.monotonic()  # when the stage was ready or a batch last finished
        while True:
            idle_s = time.monotonic() - progress_at
            if self.leave_without_batch_s is not None and idle_s >= self.leave_without_batch_s:
                self._give_up(group, f"no batch finished in {idle_s:.0f} s", batches_failed=True)
                return
            inbound: Inbound | None = None
            runner: StageRunner | None = None
            self.in_flight = (group.group_id, batch) if leader else None  # a follower's starts when opened
            try:
                # A follower listens from its mark: not from a number a refused route named.
                floor = (
                    batch
                    if leader
                    else self.marks.next_batch(self.run_id, group.group_id, step, formed_ms=formed_ms)
                )
                inbound = await self.hops.inbound(
                    Route(group.group_id, floor, stage), previous, follow=not leader
                )
                if not leader:
                    try:
                        await inbound.accepted(self.hop.connect_timeout_s)
                    except PipelineWireError as exc:  # nothing opened yet: nothing in flight, wait again
                        logger.debug("stage %d of group %s… idle: %s", stage, group.group_id[:16], exc)
                        continue
                    batch = self._followed(group.group_id, step, formed_ms, inbound.route.batch)
                spec = GroupSpec(
                    self.run_id, group.policy_step, batch, self.layout, tuple(group.members), group.nonce
                )
                # Tokenizing the batch's prompts is CPU work: off the loop, which serves heartbeats and streams.
                processor = StageProcessor(model, await asyncio.to_thread(self.work_for, group, batch))
                runner = StageRunner(spec, stage, processor, self.identity, self.hop, self.tamper)
                if not leader:  # the route's number is the predecessor's signed word before it is recorded
                    await runner.read_opening(inbound)
                await asyncio.to_thread(
                    partial(self.marks.use, formed_ms=formed_ms), self.run_id, group.group_id, step, batch
                )  # durable before signed
                self.in_flight = (group.group_id, batch)
                dial = partial(
                    self.hops.dial,
                    runner.route(following),
                    group.members[following],
                    self.hop.connect_timeout_s,
                )
                await runner.run(inbound, dial)
            # ProofError: our own activations admit no commitment (beyond bf16's range): this batch is lost, the
            # stage loop is not.
            except (PipelineError, PipelineWireError, ProofError, OSError, EOFError, TimeoutError) as exc:
                if self.in_flight is not None:
                    why = str(exc) or type(exc).__name__
                    logger.info("batch %d of group %s… abandoned: %s", batch, group.group_id[:16], why)
                    self._abandon(group.group_id, batch, why)
                    self.in_flight = None  # what follows hands in what was made; the batch is over (counted)
                    lost = await asyncio.to_thread(self._lost, group, batch, stage, runner, why)
                    if lost is not None and self.on_lost is not None:
                        await self.on_lost(lost)
                    batch += 1
                    if runner is not None and runner.ring_closed:  # else a member not there yet: see above
                        broken += 1
                    if self.leave_after_broken is not None and broken >= self.leave_after_broken:
                        self._give_up(
                            group, f"{broken} batches in a row broke, the last: {why}", batches_failed=True
                        )
                        return
                else:  # a follower that opened no batch: the leader's next one is still to be taken
                    logger.info("stage %d of group %s… not started: %s", stage, group.group_id[:16], exc)
                self.in_flight = None
                await asyncio.sleep(self.retry_s)
                continue
            finally:
                if inbound is not None:
                    inbound.close()
            if self.task is not asyncio.current_task():
                return  # stopped while the batch ended: it counts as abandoned (stop records it), not done
            self.in_flight = None
            # The record's canonical JSON and signature over every frame header, the completions and the stacked
            # final states: CPU work, off the loop. The runner is done with the processor and its streams (run()
            # returned), so the thread reads state nothing else touches.
            done = await asyncio.to_thread(self._done, group, batch, stage, processor, runner)
            # The owner may hold here while its outbox is full (the validator's back-pressure): not the group's
            # fault, so the time without a finished batch starts after.
            await self.on_batch(done)
            batch += 1
            broken = 0
            progress_at = time.monotonic()

    def _give_up(self, group: GroupRecord, why: str, *, batches_failed: bool) -> None:
        """End this group's stage task (the caller returns) and tell the owner, which leaves the group."""
        logger.warning("giving up group %s…: %s", group.group_id[:16], why)
        self.given_up.pop(group.group_id, None)
        self.given_up[group.group_id] = why
        while len(self.given_up) > ABANDONED_KEPT:
            del self.given_up[next(iter(self.given_up))]
        if self.on_give_up is not None:
            self.on_give_up(group, why, batches_failed)

    def _done(
        self, group: GroupRecord, batch: int, stage: int, processor: StageProcessor, runner: StageRunner
    ) -> BatchDone:
        """What a finished batch hands in: this stage's signed record; on the last stage its completions and
        the final hidden states its rollout proofs commit to. Blocking (a worker thread's)."""
        outputs = processor.outputs.tokens
        record = stage_record(stage, self.identity, runner.chain, runner.writer, outputs)
        last = processor.model.last
        completions = processor.completions() if last else None
        states = processor.final_states() if last else None
        return BatchDone(group, batch, stage, record, completions, states)

    def _followed(self, group_id: str, step: int, formed_ms: int, batch: int) -> int:
        """`batch`, the number a predecessor's (unsigned) route names, if a follower may take it: not one it
        used, and at most `max_batch_jump` past its mark; PipelineError naming both otherwise."""
        mark = self.marks.next_batch(self.run_id, group_id, step, formed_ms=formed_ms)
        if batch < mark:
            raise PipelineError(
                f"the predecessor opened batch {batch}; this node already used batches below {mark}"
            )
        if batch - mark > self.max_batch_jump:
            raise PipelineError(
                f"the predecessor opened batch {batch}, {batch - mark} past this node's next ({mark}); at most "
                f"{self.max_batch_jump} ahead is taken"
            )
        return batch

    def _lost(
        self, group: GroupRecord, batch: int, stage: int, runner: StageRunner | None, why: str
    ) -> BatchLost | None:
        """What this stage hands in for a batch that broke; None when it never began (no opening read from the
        predecessor: nothing was exchanged that a validator could judge). Blocking (a worker thread's: it signs
        the partial record); the runner's streams are closed by then, so nothing else touches its state."""
        if runner is None or runner.chain.opening is None:
            return None
        stages = self.layout.stages
        neighbours = {"previous": (stage - 1) % stages, "following": (stage + 1) % stages}
        side = neighbours.get(runner.broke) if runner.broke is not None else None
        broken_by = group.members[side] if side is not None else None
        if runner.fraud is not None:
            return BatchLost(group, batch, stage, why, runner.fraud, None, broken_by)
        outputs = known_tokens(runner.processor)
        partial = stage_record(stage, self.identity, runner.chain, runner.writer, outputs)
        return BatchLost(group, batch, stage, why, None, partial, broken_by)
