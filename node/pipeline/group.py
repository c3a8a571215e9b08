"""A pipelined group over real streams: each stage a task that reads its predecessor's frames, computes off
the event loop, and streams its own frames to its successor (with an injected per-hop delay).

Micro-batches overlap by construction: a stage handles whichever frame arrives next, so while micro-batch m
travels a hop or is computed elsewhere, the stage works on m + 1. Any failure (a peer too slow, a bad frame,
a commitment that does not match its tensor) ends that stage's task; the TaskGroup then cancels every other
stage: the group dissolves and the batch is abandoned, with the receiver's evidence kept for a fraud report.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeVar

from ...p2p.identity import Identity
from ...p2p.pipeline.errors import PipelineWireError
from ...p2p.pipeline.frames import FrameReader, FrameWriter
from ...p2p.pipeline.transport import DelayedSender, Inbound, Route, StreamPair
from ...proofs.pipeline.records import HopFraud, SignedStageRecord
from ..engine.types import Completion
from .driver import GroupSpec, Tamper, deliver_checked, stage_record
from .errors import FraudDetected, PipelineError
from .hops import LoopbackHops
from .stage import Outgoing, StageProcessor
from .work import frame_shapes

logger = logging.getLogger(__name__)
T = TypeVar("T")
Side = Literal["previous", "following"]  # a stage's neighbour: the one it reads from, the one it writes to


@dataclass(frozen=True)
class HopSettings:
    delay_s: float = 0.0  # injected one-way latency per hop
    frame_timeout_s: float = 30.0  # longest wait for a peer's next frame
    connect_timeout_s: float = 10.0  # longest wait for a neighbour's stream, either way


class StageRunner:
    def __init__(
        self,
        spec: GroupSpec,
        stage: int,
        processor: StageProcessor,
        identity: Identity,
        hop: HopSettings,
        tamper: Tamper | None = None,
    ) -> None:
        self.spec, self.stage, self.processor, self.identity, self.hop = spec, stage, processor, identity, hop
        self.tamper = tamper
        self.writer = FrameWriter(identity, spec.opening(stage))
        # Refuses an opening for another group, batch or stage, and a frame declaring a shape the batch's schedule
        # does not call for before its tensor is read (the wire allows far more than any frame of a batch).
        shapes = frame_shapes(processor.work, processor.model.config.hidden_size, processor.dtype)
        self.chain = spec.reader(stage, shapes)
        self.fraud: HopFraud | None = None  # evidence when the predecessor sent a frame its commitment belies
        self.frames: FrameReader | None = None  # the predecessor's stream, once its opening was read
        # The ring closed: every member took this batch (the leader read the last stage's opening, which comes
        # round only after each stage took its predecessor's stream and its successor took its own; a follower
        # read a frame after the opening, which the leader sends only then). A batch that breaks before is
        # mostly a member not there yet (loading its stage, or holding back while its outbox is full), which
        # StageHost does not count as a neighbour breaking batches (host.py).
        self.ring_closed = False
        # Which neighbour's stream failed first ("previous" or "following"), when a wait or send on it did;
        # None when the batch broke otherwise (our own computation, a cancellation) or has not broken.
        self.broke: Side | None = None
        # (what, micro-batch, start, end) on the monotonic clock: "compute" spans of this stage and "flight"
        # spans of its frames on the hop; benchmarks/pipeline.py and the tests read the overlap from them.
        self.timeline: list[tuple[str, int, float, float]] = []

    def route(self, stage: int) -> Route:
        """The route of this batch's stream into `stage`."""
        return Route(self.spec.group_id, self.spec.batch, stage)

    async def read_opening(self, inbound: Inbound) -> None:
        """Read the predecessor's signed opening of this batch (the exact one `spec` expects), each wait bounded:
        a follower does this before it records the batch number or signs anything for it, since the number came
        from the unsigned route. The leader sends first, so the predecessor's opening never waits on ours."""
        received, _ = await self._on("previous", inbound.accepted(self.hop.connect_timeout_s))
        frames = FrameReader(received, self.chain, timeout_s=self.hop.frame_timeout_s)
        await self._on("previous", frames.read_opening())
        self.frames = frames

    async def run(self, inbound: Inbound, open_next: Callable[[], Awaitable[StreamPair]]) -> None:
        """Generate the batch: `inbound` brings the predecessor's stream, `open_next` opens ours to the
        successor (each bounded by `connect_timeout_s`); both are closed when this returns or fails."""
        try:
            reader, writer = await self._on("following", open_next())
        except BaseException:
            inbound.close()
            raise
        out = DelayedSender(writer, self.hop.delay_s, name=f"pipeline-send-stage{self.stage}")
        # The successor never writes on our stream: its end (EOF or reset) before we sent our end frame means it
        # left mid-batch. Watched while we wait for our predecessor, which may be waiting on the same departed
        # node: the batch is abandoned at once, not when a wait's deadline passes.
        hangup = asyncio.create_task(reader.read(1), name=f"pipeline-hangup-stage{self.stage}")
        hangup.add_done_callback(_retrieve)  # a reset is an outcome here, not an error to log
        ended = False
        try:
            await self._on("following", out.send(self.writer.opening()))
            frames = self.frames
            if frames is None:  # the leader: its predecessor (the last stage) opens once ours reached it
                received, _ = await self._unless_hung_up(hangup, inbound.accepted(self.hop.connect_timeout_s))
                frames = FrameReader(received, self.chain, timeout_s=self.hop.frame_timeout_s)
                await self._unless_hung_up(hangup, frames.read_opening())
                self.frames = frames
                self.ring_closed = True
            if self.processor.model.first:
                for mb in range(len(self.processor.work.schedule)):
                    started = time.monotonic()
                    outgoing = await asyncio.to_thread(self.processor.start, mb)
                    self.timeline.append(("compute", mb, started, time.monotonic()))
                    await self._send(out, outgoing)
            while True:
                frame = await (
                    self._on("previous", frames.read_frame())
                    if ended
                    else self._unless_hung_up(hangup, frames.read_frame())
                )
                self.ring_closed = True
                if frame.header.kind == "end":
                    try:  # a middle stage learns the batch's completions here, to pass on and to record
                        await asyncio.to_thread(self.processor.on_end, frame)
                    except PipelineError:  # no completion for every sample: the predecessor's doing
                        self.broke = self.broke or "previous"
                        raise
                    break
                started = time.monotonic()
                try:
                    following = await asyncio.to_thread(deliver_checked, self.processor, frame, self.chain)
                except FraudDetected as exc:
                    self.fraud = exc.fraud
                    self.broke = self.broke or "previous"
                    raise
                except PipelineError:  # a frame the schedule does not call for: the predecessor's doing
                    self.broke = self.broke or "previous"
                    raise
                self.timeline.append(("compute", frame.header.micro_batch, started, time.monotonic()))
                if following is not None:
                    await self._send(out, following)
                if self.processor.model.first and self.processor.done:
                    await self._send(out, await asyncio.to_thread(self.processor.end_frame))
                    ended = True  # from here the successor may close: it has all it needs
            if not self.processor.model.first:  # the completions table is CPU work: off the loop
                await self._send(out, await asyncio.to_thread(self.processor.end_frame))
            await self._on("following", out.close(self.hop.frame_timeout_s))
        finally:
            hangup.cancel()
            out.task.cancel()
            writer.close()
            inbound.close()

    async def _unless_hung_up(self, hangup: asyncio.Task[bytes], waiting: Coroutine[Any, Any, T]) -> T:
        """`waiting`'s result, or PipelineWireError as soon as the successor closes our stream."""
        task = asyncio.create_task(waiting, name=f"pipeline-wait-stage{self.stage}")
        # Cancelled below when the successor hangs up (or we are stopped), it may still end with its own error
        # (the stream it read closed at the same moment): an outcome here, not an error to log.
        task.add_done_callback(_retrieve)
        try:
            await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return await self._on("previous", task)  # every wait raced with a hang-up is on the predecessor
        self.broke = self.broke or "following"
        raise PipelineWireError(
            f"stage {(self.stage + 1) % self.spec.layout.stages} closed its stream mid-batch"
        )

    async def _on(self, side: Side, waiting: Awaitable[T]) -> T:
        """`waiting`'s result; when it fails, `side` ("previous" or "following") is the first stream that broke."""
        try:
            return await waiting
        except Exception:  # a cancellation is the node stopping, no neighbour's doing
            self.broke = self.broke or side
            raise

    async def _send(self, out: DelayedSender, outgoing: Outgoing) -> None:
        if self.tamper is not None:
            outgoing = self.tamper(self.stage, outgoing)
        encoded, _ = await asyncio.to_thread(
            self.writer.frame,
            kind=outgoing.kind,
            micro_batch=outgoing.micro_batch,
            step=outgoing.step,
            rows=outgoing.rows,
            tensor=outgoing.tensor,
            dtype=outgoing.dtype,
            commitment=outgoing.commitment,
            acknowledged=self.chain.acknowledgement(),
        )
        queued = time.monotonic()
        await self._on("following", out.send(encoded))
        if outgoing.kind != "end":  # the timeline is of micro-batches' frames
            self.timeline.append(("flight", outgoing.micro_batch, queued, queued + self.hop.delay_s))


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


@dataclass
class GroupRun:
    completions: list[Completion]
    records: list[SignedStageRecord]
    runners: list[StageRunner]


def overlapped_flights(runners: Sequence[StageRunner]) -> int:
    """How many frames were in flight on a hop while some stage computed another micro-batch: the latency
    micro-batching hides (0 with a single micro-batch, whose ring is strictly sequential)."""
    computes = [(mb, a, b) for r in runners for kind, mb, a, b in r.timeline if kind == "compute"]
    flights = [(mb, a, b) for r in runners for kind, mb, a, b in r.timeline if kind == "flight"]
    return sum(
        any(mb != other and a < end and start < b for other, a, b in computes) for mb, start, end in flights
    )


async def run_group(
    spec: GroupSpec,
    processors: Sequence[StageProcessor],
    identities: Sequence[Identity],
    hop: HopSettings,
    *,
    tamper: Tamper | None = None,
    runners: list[StageRunner] | None = None,
) -> GroupRun:
    """Every stage of one group as tasks of this event loop, over TCP on 127.0.0.1. `runners`: a list this
    fills with the stage runners before they start, for a caller that inspects them after a failure."""
    stages = spec.layout.stages
    made = [StageRunner(spec, k, processors[k], identities[k], hop, tamper) for k in range(stages)]
    if runners is not None:
        runners.extend(made)
    runners = made
    hops = LoopbackHops()
    members = spec.members
    inbound = [await hops.inbound(r.route(k), members[(k - 1) % stages]) for k, r in enumerate(runners)]
    async with asyncio.TaskGroup() as tasks:
        for k, runner in enumerate(runners):
            nxt = (k + 1) % stages
            dial = partial(hops.dial, runner.route(nxt), members[nxt], hop.connect_timeout_s)
            tasks.create_task(runner.run(inbound[k], dial), name=f"pipeline-stage{k}")
    # Signing every stage's record over all its frame headers is CPU work: off the loop, as the stages' compute.
    return await asyncio.to_thread(_group_run, processors, identities, runners)


def _group_run(
    processors: Sequence[StageProcessor], identities: Sequence[Identity], runners: list[StageRunner]
) -> GroupRun:
    # Each stage records the completions it knows: the last stage sampled them, stage 0 received them, a middle
    # stage read them from its predecessor's end frame.
    records = [
        stage_record(k, identities[k], r.chain, r.writer, processors[k].outputs.tokens)
        for k, r in enumerate(runners)
    ]
    return GroupRun(processors[-1].completions(), records, runners)
