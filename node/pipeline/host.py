"""Runs this node's stage of the group its PipelineMember joined, batch after batch, with w3-pipe's StageRunner.

`on_change` (given to PipelineMember) is the only entry: leaving a group cancels the stage task, which
abandons the batch in flight (its runner's streams close; no stage record is made for a batch that did not
end, so nothing partial can be handed to a validator), and joining one starts a new named task. A batch that
fails (a peer gone, a frame late or malformed) is abandoned the same way; the task then waits `retry_s` and
starts the next batch number while the group stands, and the member's next poll dissolves it otherwise.

Where the next stage listens comes from a `Rendezvous`. `LocalRendezvous` serves stages in one process (the
tests and benchmarks); across machines the stream would open over hivemind's libp2p streams to the member's
peer id from its heartbeat (p2p/pipeline/transport.py, docs/pipeline.md "What is built, what is not").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ...p2p.identity import Identity
from ...p2p.pipeline.errors import PipelineWireError
from ...p2p.pipeline.layout import StageLayout
from ...p2p.swarm.group_records import GroupRecord
from ...proofs.pipeline.records import GroupSpec, SignedStageRecord
from ..engine.types import Completion
from .driver import stage_record
from .errors import PipelineError
from .group import HopSettings, StageRunner
from .stage import StageProcessor
from .stage_model import StageModel
from .work import PipelineWork

logger = logging.getLogger(__name__)

Key = tuple[str, int, int]  # (group id, batch, stage)
STOP_TIMEOUT_S = 10.0


class Rendezvous(Protocol):
    def offer(self, key: Key, port: int) -> None: ...

    async def port_of(self, key: Key, timeout_s: float) -> int: ...


class LocalRendezvous:
    """Listening ports of the stages of groups whose members all run in this process."""

    def __init__(self) -> None:
        self._ports: dict[Key, asyncio.Future[int]] = {}

    def _future(self, key: Key) -> asyncio.Future[int]:
        return self._ports.setdefault(key, asyncio.get_running_loop().create_future())

    def offer(self, key: Key, port: int) -> None:
        future = self._future(key)
        if not future.done():
            future.set_result(port)

    async def port_of(self, key: Key, timeout_s: float) -> int:
        try:
            return await asyncio.wait_for(asyncio.shield(self._future(key)), timeout_s)
        except TimeoutError:
            raise PipelineWireError(
                f"stage {key[2]} of group {key[0][:16]}… did not listen in {timeout_s:.0f} s"
            ) from None


@dataclass(frozen=True)
class BatchDone:
    group: GroupRecord
    batch: int
    stage: int
    record: SignedStageRecord
    completions: list[Completion] | None  # the last stage's; None elsewhere


class StageHost:
    def __init__(
        self,
        identity: Identity,
        run_id: str,
        checkpoint: Path,
        layout: StageLayout,
        work_for: Callable[[GroupRecord, int], PipelineWork],
        rendezvous: Rendezvous,
        hop: HopSettings,
        on_batch: Callable[[BatchDone], Awaitable[None]],
        *,
        retry_s: float = 0.5,
        stop_timeout_s: float = STOP_TIMEOUT_S,
    ) -> None:
        self.identity, self.run_id, self.checkpoint, self.layout = identity, run_id, checkpoint, layout
        self.work_for, self.rendezvous, self.hop, self.on_batch = work_for, rendezvous, hop, on_batch
        self.retry_s, self.stop_timeout_s = retry_s, stop_timeout_s
        self.task: asyncio.Task[None] | None = None
        self.in_flight: tuple[str, int] | None = None  # (group id, batch) being generated now
        self.abandoned: list[tuple[str, int, str]] = []  # (group id, batch, why)

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
        task.cancel()
        await asyncio.wait({task}, timeout=self.stop_timeout_s)
        if not task.done():
            raise PipelineError(
                f"stage task {task.get_name()} ignored its cancellation for {self.stop_timeout_s:.1f} s"
            )
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
        if self.in_flight is not None:
            self.abandoned.append((*self.in_flight, why))
            self.in_flight = None

    async def _run(self, group: GroupRecord) -> None:
        stage = group.stage_of(self.identity.node_id)
        if stage is None:
            raise PipelineError(f"group {group.group_id[:16]}… does not name this node")
        model = await asyncio.to_thread(StageModel.load, self.checkpoint, self.layout, stage)
        batch = 0
        while True:
            spec = GroupSpec(self.run_id, group.policy_step, batch, self.layout, tuple(group.members))
            processor = StageProcessor(model, self.work_for(group, batch))
            runner = StageRunner(spec, stage, processor, self.identity, self.hop)
            self.in_flight = (group.group_id, batch)
            try:
                port = await runner.listen()
                self.rendezvous.offer((group.group_id, batch, stage), port)
                following = (group.group_id, batch, (stage + 1) % self.layout.stages)
                await runner.run(await self.rendezvous.port_of(following, self.hop.connect_timeout_s))
            except (PipelineError, PipelineWireError, OSError, EOFError, TimeoutError) as exc:
                runner.server.close()
                logger.info("batch %d of group %s… abandoned: %s", batch, group.group_id[:16], exc)
                self.abandoned.append((group.group_id, batch, str(exc) or type(exc).__name__))
                self.in_flight = None
                await asyncio.sleep(self.retry_s)
                batch += 1
                continue
            if self.task is not asyncio.current_task():
                return  # stopped while the batch ended: it counts as abandoned (stop records it), not done
            self.in_flight = None
            outputs = processor.outputs.tokens
            record = stage_record(stage, self.identity, runner.chain, runner.writer, outputs)
            completions = processor.completions() if processor.model.last else None
            await self.on_batch(BatchDone(group, batch, stage, record, completions))
            batch += 1
