"""The rollout loop: newest verified checkpoint within the window -> assigned batch -> signed file in the outbox.

Torch work (loading the model, generating, proving, writing Parquet) runs on one dedicated worker thread,
so the event loop keeps answering the status API, heartbeats and hand-offs while a batch is generated,
and the model is only ever touched by that thread. A cancelled batch is abandoned: its staged file stays
in the outbox's tmp/ (removed at the next start), never in pending/.

The batch counter is persisted per step before a batch starts, so a restart never repeats an assignment
(an identical file would be a duplicate to the validator) and at worst skips one counter value.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ...p2p.identity import Identity
from ...p2p.weights.errors import WeightsError
from ...proofs.rollout_file import signature_path
from ..engine import InferenceEngine, load_engine
from ..environments import Environment
from ..errors import NodeError, PromptError
from ..run.producer import BatchSpec, ProducedBatch, produce_rollout_file
from ..run.settings import engine_for_run, load_run_tasks
from ..run.validation import RunTasks
from .checkpoints import CheckpointKeeper
from .outbox import Outbox
from .preflight import PreflightError, check_cuda_for_model, run_checks
from .settings import StartSettings
from .state import NodeState

logger = logging.getLogger(__name__)

COUNTER_FILE = "batch_counter.json"
_IDLE_POLL_S = 0.5  # how often to look again while no checkpoint is usable


class RolloutLoop:
    # How one batch becomes a signed file (run on the torch worker). The devnet's adversaries
    # (trainer/devnet/attacks.py) substitute a cheating producer; production code never does.
    produce = staticmethod(produce_rollout_file)

    def __init__(
        self,
        settings: StartSettings,
        identity: Identity,
        keeper: CheckpointKeeper,
        outbox: Outbox,
        state: NodeState,
        executor: ThreadPoolExecutor,
        on_committed: Any = None,
        environment: Environment | None = None,
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.keeper = keeper
        self.outbox = outbox
        self.state = state
        self.executor = executor
        self.on_committed = on_committed  # (sha256, summary) after each commit: wakes the hand-off task
        self.environment = (
            environment  # the run's, opened once by the caller (None: opened at each checkpoint load)
        )
        self.batches_done = 0
        self._engine: InferenceEngine | None = None
        self._tasks: RunTasks | None = None
        self._engine_step: int | None = None
        self._counter_path = outbox.root / COUNTER_FILE

    async def _in_worker(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run(self, max_batches: int | None = None) -> None:
        """Produce batches until cancelled, or until `max_batches` were committed."""
        while max_batches is None or self.batches_done < max_batches:
            step = self.keeper.usable_step()
            if step is None:
                self.state.state = (
                    "waiting for a run announcement"
                    if self.state.announced_step is None
                    else "waiting for a checkpoint within the async window"
                )
                await asyncio.sleep(_IDLE_POLL_S)
                continue
            pending = await asyncio.to_thread(self.outbox.pending_count)
            if pending >= self.settings.max_pending_files:
                # Back-pressure: files the validator has not taken yet would only go stale in the outbox.
                self.state.state = f"waiting: {pending} files not handed off yet"
                await asyncio.sleep(_IDLE_POLL_S)
                continue
            if step != self._engine_step:
                try:
                    await self._load(step)
                except (PreflightError, PromptError):
                    # No room on the GPU, or the run's prompts cannot be built with the run's model (its chat
                    # template fails, or a system prompt without one): the node cannot work at all, so it stops
                    # and says why instead of refusing every checkpoint of the run in turn.
                    raise
                except NodeError as exc:  # verified bytes, but not a model this engine can run
                    self.keeper.discard(step, f"cannot load it: {exc}")
                    continue
            await self.produce_one(step)

    async def _load(self, step: int) -> None:
        self.state.state = f"loading checkpoint step {step}"
        try:  # a version held only in part (a pipeline node's shards) is never loaded as one model
            directory = self.keeper.whole_checkpoint_dir(step)
        except WeightsError as exc:
            raise NodeError(str(exc)) from exc
        self._engine = self._tasks = None  # let the old model go before the new one is loaded
        self._engine, self._tasks = await self._in_worker(self._load_blocking, directory)
        self._engine_step = step
        logger.info("generating with checkpoint step %d", step)

    def _load_blocking(self, directory: Path) -> tuple[InferenceEngine, RunTasks]:
        if self.settings.engine.device == "cuda":
            run_checks([check_cuda_for_model(directory, self.settings.min_gpu_memory_mb << 20)])
        engine = load_engine(
            directory, **engine_for_run(self.settings.engine, self.settings.run).model_dump()
        )
        return engine, load_run_tasks(self.settings.run, directory, self.environment)

    def _next_counter(self, step: int) -> int:
        try:
            saved = json.loads(self._counter_path.read_text())
            counter = int(saved["next"]) if int(saved["step"]) == step else 0
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            counter = 0
        tmp = self._counter_path.with_name(f".{COUNTER_FILE}.tmp")
        tmp.write_text(json.dumps({"step": step, "next": counter + 1}))
        os.replace(tmp, self._counter_path)
        return counter

    async def produce_one(self, step: int) -> None:
        assert self._engine is not None and self._tasks is not None
        s = self.settings
        spec = BatchSpec(
            run_id=s.run.run_id,
            run_seed=s.run.run_seed,
            policy_step=step,
            batch_counter=await asyncio.to_thread(self._next_counter, step),
            prompts=s.prompts,
            samples=s.run.samples,
            temperature=s.run.temperature,
            max_new_tokens=s.run.max_new_tokens,
        )
        self.state.working_step = step
        self.state.state = f"generating batch {spec.batch_counter} with checkpoint step {step}"
        staged = self.outbox.staging_path(f"step{step}-batch{spec.batch_counter}.parquet")
        batch: ProducedBatch = await self._in_worker(
            self.produce, self._engine, self._tasks, self.identity, spec, staged
        )
        sig = signature_path(staged)
        sha256 = json.loads(await asyncio.to_thread(sig.read_bytes))["sha256"]
        entry = await asyncio.to_thread(self.outbox.commit, sha256, staged, sig, step)
        tokens = sum(len(r.output_ids) for r in batch.rows)
        self.state.count_rollout("generated")
        self.state.record_batch(tokens, batch.generation_seconds)
        self.batches_done += 1
        mean_reward = sum(r.reward for r in batch.rows) / len(batch.rows)
        summary = (
            f"batch {spec.batch_counter} of step {step}: {len(batch.rows)} samples, {tokens} tokens, "
            f"{self.state.tokens_per_second or 0:.0f} tok/s, mean reward {mean_reward:.3f}"
        )
        logger.debug(
            "%s committed as %s; CPU-s: generation %.3f, proofs and rewards %.3f, file %.3f",
            summary,
            entry.sha256,
            batch.generation_cpu_s,
            batch.proof_cpu_s,
            batch.file_cpu_s,
        )
        if self.on_committed is not None:
            self.on_committed(entry.sha256, summary)
