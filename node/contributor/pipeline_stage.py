"""A `start --pipeline` node's work: serve a stage of the operator's groups and hand in what each batch made.

In place of the rollout loop, the daemon runs this as its `pipeline-member` task. Once the node holds a
checkpoint within the window it measures its layer throughput on a stage it offers, then every `poll_s`:
publishes the checkpoint step it holds (heartbeat and offer), and lets `PipelineMember` (node/pipeline/member.py)
republish its signed stage offer, read the operator-signed group records and join, keep or leave a group. A
change reaches `StageHost` (node/pipeline/host.py), whose stage task, one per group and started here under the
daemon's supervisor, runs the group's batches over libp2p streams (`SwarmHops`: only the predecessor the record
names may stream to this node).

What a batch makes goes to the validator through the same outbox and hand-off as a rollout file
(node/contributor/outbox.py, delivery.py): after every finished batch this member's stage file
(node/pipeline/rollouts.py `write_member_file`: the group's rows, its stage record, on the last stage the
rollout proofs); for a batch that broke, the fraud report against its predecessor when it sent a frame its
commitment belies, else this member's partial record. Files are staged in the outbox's tmp/ and committed to
pending/ with their signature, so a crash leaves nothing half-written to send. (The outbox names every entry
`<sha256>.parquet`; a report's bytes are JSON, and its envelope says which kind it is.)

What a hostile neighbour can make this node write is bounded: every stage, not only stage 0, takes no further
batch while `max_pending_files` files wait for hand-off; a file about a broken batch is written only while
fewer than that wait, and only within `BrokenFileBudget`'s limits per group and per neighbour
(node/pipeline/broken_files.py: `pipeline.max_broken_files_per_group`, `max_broken_files_per_peer` within
`broken_files_window_s`; fraud reports within a quota of their own; a partial record charged to the
neighbour whose stream broke when known); a broken batch beyond them is counted (`stage_files_withheld_total`)
and logged, not written. After `pipeline.leave_after_broken` batches of a group in a row broke once every member
had taken them, or none finished in `pipeline.leave_without_batch_s`, the host gives the group up and the member
leaves it, not rejoining it for `pipeline.avoid_s` (node/pipeline/host.py, member.py).

The group's work is `work_for` (node/pipeline/work.py) over the run's tasks with the checkpoint's tokenizer,
loaded off the event loop before the stage task starts. The batch's shape (problems per batch, micro-batch cut)
is the run's, `run.pipeline.prompts` and `run.pipeline.micro_batch_size`: pinned by the operator's announcement
(a node configured otherwise stops, naming both values) and by the signed group record, never the node's own
`prompts`, so that every member cuts alike; both are recorded in every file, and the validator holds them to
the run's. Deriving the work, signing records and writing files are CPU work: all of it runs in worker threads,
never on the event loop, which serves the node's heartbeats and libp2p streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from ...p2p.errors import P2PError
from ...p2p.identity import Identity
from ...p2p.pipeline.layout import StageLayout
from ...p2p.swarm import Swarm
from ...p2p.swarm.group_records import GroupRecord
from ...proofs.rollout_file import signature_path
from ..engine.hf import eos_and_pad
from ..environments import Environment
from ..pipeline.batch_marks import BatchMarks
from ..pipeline.broken_files import BrokenFileBudget, Withheld
from ..pipeline.driver import Tamper
from ..pipeline.group import HopSettings
from ..pipeline.hops import SwarmHops
from ..pipeline.host import BatchDone, BatchLost, LoadStage, StageHost
from ..pipeline.member import MemberSettings, PipelineMember
from ..pipeline.offer import measure_layer_throughput
from ..pipeline.rollouts import write_member_file, write_member_partial, write_member_report
from ..pipeline.stage_model import StageModel
from ..pipeline.work import GroupBatch, PipelineWork, work_for
from ..run.settings import load_run_tasks
from ..run.validation import RunTasks
from .checkpoints import CheckpointKeeper
from .outbox import Outbox
from .settings import StartSettings
from .state import NodeState
from .status import PipelineStatus

logger = logging.getLogger(__name__)

MARKS_FILE = "pipeline/batch_marks.json"
_IDLE_POLL_S = 0.5  # how often to look again while no checkpoint is usable
_WITHHELD_GROUPS_KEPT = 64  # groups whose withheld files are counted for the log (the oldest forgotten first)
_TASKS_KEPT = 2  # checkpoints whose tasks (tokenizer) stay loaded: the current step and the one before


def offered_stages(settings: StartSettings, layout: StageLayout) -> frozenset[int]:
    """The stages of `layout` the node offers: `pipeline.stages`, or every stage when it is empty. The node
    fetches the checkpoint's shards of these only (node/pipeline/weights.py `StageSelection`)."""
    stages = settings.pipeline.stages
    return frozenset(stages) if stages else frozenset(range(layout.stages))


def own_prompts_note(settings: StartSettings, layout: StageLayout) -> str | None:
    """The log line for a node whose own `prompts` was set otherwise than the run's group batch, which it adopts:
    `prompts` sizes a node's monolithic rollout batches, while every member of a group must cut its batches as
    the run pins them (`run.pipeline.prompts`). None when it was not set or agrees."""
    if "prompts" not in settings.model_fields_set or settings.prompts == layout.prompts:
        return None
    return (
        f"prompts = {settings.prompts} set here is not used for pipelined groups: a group's batch has the "
        f"run's run.pipeline.prompts = {layout.prompts} problems (every member must cut alike); using "
        f"{layout.prompts}"
    )


class PipelineStage:
    # Hooks for the devnet's adversaries (trainer/devnet/pipeline_attacks.py, substituted by node/cli/adversary.py);
    # production nodes never set them.
    tamper: Tamper | None = None
    load_stage: LoadStage = staticmethod(StageModel.load)
    measure_throughput: Callable[[StageModel], float] = staticmethod(measure_layer_throughput)

    def __init__(
        self,
        settings: StartSettings,
        identity: Identity,
        swarm: Swarm,
        keeper: CheckpointKeeper,
        outbox: Outbox,
        state: NodeState,
        data_dir: Path,
        *,
        environment: Environment | None,
        on_committed: Callable[[str, str], None],
        supervise: Callable[[asyncio.Task[Any]], None],
        request_stop: Callable[[str], None],
    ) -> None:
        layout = settings.run.pipeline
        if layout is None:  # StartSettings refuses --pipeline without a layout; this is the type's guard
            raise ValueError("a pipeline stage needs the run's stage layout (run.pipeline)")
        self.settings, self.identity, self.swarm, self.keeper = settings, identity, swarm, keeper
        self.outbox, self.state, self.environment = outbox, state, environment
        self.layout: StageLayout = layout
        self.on_committed, self.supervise, self.request_stop = on_committed, supervise, request_stop
        p = settings.pipeline
        self.offered = offered_stages(settings, layout)
        self.marks = BatchMarks(data_dir / MARKS_FILE)
        self.hop = HopSettings(frame_timeout_s=p.frame_timeout_s, connect_timeout_s=p.connect_timeout_s)
        self._tasks: dict[int, tuple[RunTasks, int, int]] = {}  # step -> (tasks, eos id, pad id)
        self._tasks_lock = threading.Lock()
        self.host: StageHost | None = None
        self.member: PipelineMember | None = None
        self.broken_files = BrokenFileBudget(
            p.max_broken_files_per_group,
            p.max_broken_files_per_peer,
            p.broken_files_window_s,
            fraud_per_group=p.max_fraud_reports_per_group,
            fraud_per_peer=p.max_fraud_reports_per_peer,
        )
        self._withheld_per_group: dict[str, int] = {}  # for the log: a warning at 1, 2, 4, 8... per group
        self.group: GroupRecord | None = None  # the group it runs a stage of now
        self._abandoned_counted = 0
        state.pipeline = PipelineStatus()
        note = own_prompts_note(settings, layout)
        if note is not None:
            logger.warning("%s", note)

    # ----- the supervised task ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Wait for a checkpoint, measure, then follow the groups until cancelled (the host stops with it)."""
        s, p = self.settings, self.settings.pipeline
        step = await self._usable_step()
        throughput = await asyncio.to_thread(self._measure, step)
        logger.info(
            "pipeline stage: offering stages %s of %s at %.0f layer-tokens/s",
            sorted(self.offered),
            self.layout.boundaries,
            throughput,
        )
        streams = await self.swarm.serve_pipeline()
        self.host = StageHost(
            self.identity,
            s.run.run_id,
            self.keeper.checkpoint_dir,
            self.layout,
            self._work,
            SwarmHops(streams, self.swarm.pipeline_peer),
            self.hop,
            self._on_batch,
            on_lost=self._on_lost,
            marks=self.marks,
            tamper=self.tamper,
            load_stage=self.load_stage,
            retry_s=p.retry_s,
            max_batch_jump=p.max_batch_jump,
            leave_after_broken=p.leave_after_broken,
            leave_without_batch_s=p.leave_without_batch_s,
            on_give_up=self._give_up,
        )
        self.member = member = PipelineMember(
            self.swarm,
            self.layout,
            MemberSettings(
                stages=self.offered,
                layer_tokens_per_s=throughput,
                poll_s=p.poll_s,
                stale_after_s=p.stale_after_s,
                round_grace_s=p.round_grace_s,
                avoid_s=p.avoid_s,
            ),
            self._on_change,
        )
        try:
            while True:
                self._hold(self.keeper.usable_step())
                self._count_abandoned()
                try:
                    await member.tick()
                except (OSError, EOFError, P2PError) as exc:  # the DHT child answered too slowly: next round
                    self.state.error(f"pipeline membership round failed: {exc}")
                    logger.warning("pipeline membership round failed: %s", exc)
                await asyncio.sleep(p.poll_s)
        finally:
            await self.host.stop("the node is stopping")
            streams.close()

    async def _usable_step(self) -> int:
        while (step := self.keeper.usable_step()) is None:
            self.state.state = (
                "waiting for a run announcement"
                if self.state.announced_step is None
                else "waiting for a checkpoint within the async window"
            )
            await asyncio.sleep(_IDLE_POLL_S)
        self._hold(step)
        return step

    def _hold(self, step: int | None) -> None:
        """Publish the checkpoint this node holds: groups are per step, and a member's heartbeat and offer say
        which it can run (the peers watcher copies the same into the heartbeat every interval)."""
        self.state.working_step = step
        self.swarm.policy_step = step
        if self.state.pipeline is not None and self.state.pipeline.group_id is None:
            self.state.state = f"offering stages {sorted(self.offered)} at step {step}; in no group"

    def _count_abandoned(self) -> None:
        assert self.host is not None
        new = self.host.abandoned_count - self._abandoned_counted
        if new > 0:
            self.state.count_stage_abandoned(new)
            self._abandoned_counted += new

    def _measure(self, step: int) -> float:
        stage = min(self.offered)
        model = self.load_stage(self.keeper.checkpoint_dir(step), self.layout, stage)
        return self.measure_throughput(model)

    # ----- group changes and the group's work ---------------------------------------------------------------

    async def _on_change(self, group: GroupRecord | None, why: str) -> None:
        assert self.host is not None
        status = self.state.pipeline
        assert status is not None
        if group is not None:
            # The tokenizer and tasks of the group's checkpoint, off the loop, before the stage needs them.
            await asyncio.to_thread(self._prepare, group.policy_step)
        await self.host.on_change(group, why)
        self.group = group
        self._count_abandoned()  # the batch in flight of a group it left
        status.group_id = group.group_id if group is not None else None
        status.stage = group.stage_of(self.identity.node_id) if group is not None else None
        if group is not None and self.host.task is not None:
            self.supervise(self.host.task)  # a crash of the stage task stops the node, as any task's
            self.state.state = (
                f"stage {status.stage} of group {group.group_id[:16]}… at step {group.policy_step}"
            )

    def _give_up(self, group: GroupRecord, why: str, batches_failed: bool) -> None:
        """The host ended its stage of `group`: leave it at the next poll and keep out of it a while (naming it
        as left in the heartbeat when its batches failed, so the coordinator does not cool this node down)."""
        self.state.error(f"left group {group.group_id[:16]}…: {why}")
        if self.member is not None:
            self.member.avoid(group, why, declare=batches_failed)

    def _prepare(self, step: int) -> tuple[RunTasks, int, int]:
        """The tasks, EOS and pad ids of `step`'s checkpoint, loaded once. Blocking, and called from worker
        threads (the group change's, the stage's work and files): one lock keeps two from loading or dropping
        entries at once."""
        with self._tasks_lock:
            found = self._tasks.get(step)
            if found is None:
                directory = self.keeper.checkpoint_dir(step)
                tasks = load_run_tasks(self.settings.run, directory, self.environment)
                eos, pad = eos_and_pad(AutoConfig.from_pretrained(directory, local_files_only=True))
                found = self._tasks[step] = (tasks, eos, pad)
                for old in sorted(self._tasks)[:-_TASKS_KEPT]:
                    del self._tasks[old]
            return found

    def _batch(self, group: GroupRecord, batch: int) -> GroupBatch:
        # The record's layout is the run's (membership runs no group cut otherwise): its pinned batch shape.
        return GroupBatch.pinned(group.layout, group.group_id, group.policy_step, batch)

    def _work(self, group: GroupRecord, batch: int) -> PipelineWork:
        """StageHost's work callback (called in a worker thread: tokenizing the prompts is CPU work)."""
        tasks, eos, pad = self._prepare(group.policy_step)  # loaded by _on_change: a dictionary read here
        work, _ = work_for(
            self.settings.run, tasks, self._batch(group, batch), eos_token_id=eos, pad_token_id=pad
        )
        return work

    def _write_file(self, done: BatchDone, staged: Path) -> Path:
        """Derive the batch's work and write this member's signed stage file (blocking: a worker thread's)."""
        group, batch = done.group, self._batch(done.group, done.batch)
        tasks, eos, pad = self._prepare(group.policy_step)
        work, assignment = work_for(self.settings.run, tasks, batch, eos_token_id=eos, pad_token_id=pad)
        return write_member_file(
            staged,
            self.settings.run,
            tasks,
            batch,
            work,
            assignment,
            tuple(group.members),
            group.layout,
            group.nonce,
            done.record,
            self.identity,
            done.final_states,
        )

    # ----- what each batch makes, to the outbox -------------------------------------------------------------

    async def _on_batch(self, done: BatchDone) -> None:
        self.state.count_stage_batch()
        group = done.group
        staged = self._staged(group, done.batch, f"stage{done.stage}.parquet")
        sig = await asyncio.to_thread(self._write_file, done, staged)
        tokens = sum(len(o) for o in done.record.record.outputs)
        await self._commit(
            "stage",
            staged,
            sig,
            group.policy_step,
            f"stage {done.stage} file of batch {done.batch} of group {group.group_id[:16]}… ({tokens} tokens)",
        )
        await self._back_pressure()
        max_batches = self.settings.max_batches
        if max_batches is not None and self.state.pipeline is not None:
            if self.state.pipeline.batches >= max_batches:
                self.request_stop(f"{max_batches} stage batches done")

    async def _back_pressure(self) -> None:
        """Every stage takes the group's next batch only while fewer than `max_pending_files` files wait for
        hand-off, as the rollout loop does: the validator's back-pressure. (Every member's files go to the same
        validator, so stage 0 holding its next batch mostly stands for the group; a follower waits too, so its
        outbox stays bounded whatever its neighbours do: a predecessor's stream meanwhile is held unread, and
        that batch is abandoned at the predecessor, nothing signed for it here.)"""
        limit = self.settings.max_pending_files
        while (pending := await asyncio.to_thread(self.outbox.pending_count)) >= limit:
            self.state.state = f"waiting: {pending} files not handed off yet (the next batch waits)"
            await asyncio.sleep(_IDLE_POLL_S)

    async def _withheld(self, lost: BatchLost) -> Withheld | None:
        """Why no file is written about `lost` (None: write it): the outbox is full, or the broken-file limits
        of its group or of a neighbour that could have broken it are reached."""
        pending = await asyncio.to_thread(self.outbox.pending_count)
        if pending >= self.settings.max_pending_files:
            return Withheld("outbox_full", f"{pending} files wait for hand-off")
        members, stages = lost.group.members, self.layout.stages
        previous, following = members[(lost.stage - 1) % stages], members[(lost.stage + 1) % stages]
        # A fraud report names its predecessor; a partial record is charged to the neighbour whose stream broke
        # when the host knows it (an honest other neighbour is not), else to both.
        if lost.fraud is not None:
            suspects = [previous]
        elif lost.broken_by is not None:
            suspects = [lost.broken_by]
        else:
            suspects = [previous, following]
        return self.broken_files.admit(
            lost.group.group_id,
            (m for m in suspects if m != self.identity.node_id),
            fraud=lost.fraud is not None,
        )

    async def _on_lost(self, lost: BatchLost) -> None:
        self._count_abandoned()
        group, batch = lost.group, self._batch(lost.group, lost.batch)
        members, run = tuple(group.members), self.settings.run
        what = f"batch {lost.batch} of group {group.group_id[:16]}…"
        if lost.fraud is None and lost.partial is None:
            return
        withheld = await self._withheld(lost)
        if withheld is not None:
            self.state.count_stage_withheld(withheld.reason)
            count = self._withheld_per_group[group.group_id] = (
                self._withheld_per_group.get(group.group_id, 0) + 1
            )
            if len(self._withheld_per_group) > _WITHHELD_GROUPS_KEPT:
                del self._withheld_per_group[next(iter(self._withheld_per_group))]
            log = logger.warning if count & (count - 1) == 0 else logger.debug  # 1, 2, 4, 8... per group
            log(
                "%s broke (%s); no file written about it: %s (%d so far)", what, lost.why, withheld.why, count
            )
            return
        if lost.fraud is not None:
            staged = self._staged(group, lost.batch, f"stage{lost.stage}-fraud.json")
            sig = await asyncio.to_thread(
                write_member_report,
                staged,
                run,
                batch,
                members,
                group.layout,
                group.nonce,
                lost.fraud,
                self.identity,
            )
            logger.warning("%s: the previous stage sent a frame its commitment belies; reporting it", what)
            await self._commit("fraud", staged, sig, group.policy_step, f"fraud report on {what}")
        elif lost.partial is not None:
            staged = self._staged(group, lost.batch, f"stage{lost.stage}-partial.json")
            sig = await asyncio.to_thread(
                write_member_partial,
                staged,
                run,
                batch,
                members,
                group.layout,
                group.nonce,
                lost.partial,
                self.identity,
            )
            await self._commit(
                "partial", staged, sig, group.policy_step, f"partial record of {what} ({lost.why})"
            )

    def _staged(self, group: GroupRecord, batch: int, suffix: str) -> Path:
        return self.outbox.staging_path(
            f"group-{group.group_id[:16]}-step{group.policy_step}-b{batch}-{suffix}"
        )

    async def _commit(self, kind: str, staged: Path, sig: Path, step: int, summary: str) -> None:
        assert sig == signature_path(staged)
        sha256 = json.loads(await asyncio.to_thread(sig.read_bytes))["sha256"]
        await asyncio.to_thread(self.outbox.commit, sha256, staged, sig, step)
        self.state.count_stage_file(kind)
        self.state.count_rollout("generated")
        self.on_committed(sha256, summary)
