"""`prime-node trainer --fsdp`: rank 0 is the trainer service with a sharded Learner; other ranks follow it.

Rank 0 runs the whole service (DHT, weights server, inbox, consumed record) with an `FsdpLearner`. Each of
its blocking calls, made from the service's single worker thread, first tells the followers what to do over
the control group (trainer/grpo/distributed.py), then takes part in the same collectives:

    rank 0 (service)                                   ranks 1..N-1 (run_follower)
    resume(): newest state or genesis, publish  ->RESUME(step)->  load the same state directory
              shard model + AdamW                                   shard model + AdamW
    train(batch)                                ->TRAIN + samples-> the same sharded rollout step
    save_and_publish(): gather full state, save, publish             gather (their shards go to rank 0)
    close()                                     ->STOP->           return

Every rank reads the state directory from disk, so all ranks must see the same data directory (one machine,
or a shared filesystem). Rank 0 alone writes to it.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ..errors import TrainerError
from ..grpo.config import TrainerSettings
from ..grpo.distributed import Command, Control, World, close_world, init_world
from ..grpo.fsdp import SavedOptimizer, ShardedPolicy
from ..grpo.schedule import build_optimizer, build_scheduler
from ..grpo.step import RolloutStepReport
from .batch_buffer import Batch
from .config import TrainerCommandSettings
from .learner import Learner, _load
from .train_state import load_optimizer_state, save_train_state, step_dir

logger = logging.getLogger(__name__)


class FsdpLearner(Learner):
    """The Learner of rank 0: the same durable-write order, with the model sharded over the torchrun job."""

    def __init__(self, *args: Any, control: Control, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.control = control
        self.policy: ShardedPolicy | None = None
        self._busy = False  # from RESUME/TRAIN to its last collective: the followers are inside collectives

    def resume(self) -> int:
        step = super().resume()  # full weights on rank 0: genesis save, ledger recovery, publishing
        assert self.model is not None and self.optimizer is not None and self.scheduler is not None
        self._busy = True
        self.control.send(Command.RESUME, step)
        self.policy = ShardedPolicy(
            self.model,
            self.settings,
            self.control.world,
            self.optimizer.state_dict(),
            self.scheduler.state_dict(),
            self.reference,
        )
        self._busy = False
        # The service's view of the Learner (step, manifest) is unchanged; the tensors are now shards.
        self.model = self.policy.model  # type: ignore[assignment]
        self.optimizer = self.policy.optimizer
        self.scheduler = self.policy.scheduler
        self.reference = self.policy.reference  # type: ignore[assignment]
        return step

    def train(self, batch: Batch) -> RolloutStepReport:
        if self.policy is None:
            raise TrainerError("resume() must run before train()")
        if batch.step != self.step:
            raise TrainerError(f"batch reserved for step {batch.step}, the trainer holds step {self.step}")
        samples = batch.train_samples()
        self._busy = True
        self.control.send(Command.TRAIN, self.step)
        self.control.send_samples(samples)
        return self.policy.train(samples, self.pad_id)

    def _save_state(self, step: int) -> None:
        assert self.policy is not None
        gathered = self.policy.gather()
        self._busy = False
        assert gathered is not None  # rank 0 receives the full state
        weights, optimizer = gathered
        saved = SavedOptimizer(optimizer)
        save_train_state(
            self.state_root,
            step,
            self.policy.export(weights),
            saved,  # type: ignore[arg-type]
            self.policy.scheduler,
            self.tokenizer,
        )

    def close(self) -> bool:
        """Release the followers; False when a step was cut midway (they are inside a collective: torchrun
        ends them when this rank exits non-zero)."""
        if self._busy:
            logger.error("a step was interrupted midway; leaving the other ranks to torchrun")
            return False
        return _stop(self.control)


def _stop(control: Control) -> bool:
    try:
        control.send(Command.STOP)
    except RuntimeError as exc:  # a follower is already gone (e.g. torchrun forwarded SIGTERM to every rank)
        logger.warning("could not tell the other ranks to stop: %s", exc)
        return False
    return True


def run_follower(control: Control, settings: TrainerSettings, model_dir: Path, state_root: Path) -> None:
    """Ranks 1..N-1: hold a shard and repeat rank 0's steps until it says STOP."""
    # torchrun forwards SIGTERM (and a terminal's Ctrl-C reaches every rank): rank 0 then finishes the step in
    # flight, which needs these ranks, and sends STOP. torchrun SIGKILLs what is left after its grace time.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pad = AutoTokenizer.from_pretrained(model_dir, local_files_only=True).pad_token_id
    pad_id = int(pad) if pad is not None else 0
    policy: ShardedPolicy | None = None
    step = -1
    while True:
        command, argument = control.receive()
        if command is Command.STOP:
            logger.info("rank %d: stop", control.world.rank)
            return
        if command is Command.RESUME:
            step = argument
            policy = _load_policy(control.world, settings, model_dir, step_dir(state_root, step))
            logger.info("rank %d: resumed at step %d", control.world.rank, step)
        elif command is Command.TRAIN:
            if policy is None or argument != step:
                raise TrainerError(
                    f"rank 0 trains step {argument}, rank {control.world.rank} holds step {step}"
                )
            policy.train(control.receive_samples(), pad_id)
            policy.gather()
            step += 1


def _load_policy(world: World, settings: TrainerSettings, model_dir: Path, state: Path) -> ShardedPolicy:
    model = _load(state)
    model.train()
    optimizer = build_optimizer(model, settings)
    scheduler = build_scheduler(optimizer, settings)
    load_optimizer_state(state, optimizer, scheduler)
    reference = _load(model_dir) if settings.kl_coef > 0.0 else None
    return ShardedPolicy(model, settings, world, optimizer.state_dict(), scheduler.state_dict(), reference)


def run_under_torchrun(
    settings: TrainerCommandSettings, model_dir: Path, serve: Callable[[Callable[..., Learner]], int]
) -> int:
    """--fsdp on every rank: rank 0 calls `serve` with a learner factory, the others follow it."""
    world = World.from_env()
    if settings.service.threads is not None:
        torch.set_num_threads(settings.service.threads)
    control = init_world(world)
    try:
        if not world.is_leader:
            state_root = settings.path(settings.service.state_dir, "trainer") / "states"
            run_follower(control, settings.trainer, model_dir, state_root)
            return 0
        made: list[FsdpLearner] = []

        def factory(*args: Any, **kwargs: Any) -> Learner:
            made.append(FsdpLearner(*args, control=control, **kwargs))
            return made[-1]

        released = False
        try:
            code = serve(factory)
        finally:
            if made:
                released = made[-1].close()
            else:  # the service failed before making its learner: the followers wait for a first command
                released = _stop(control)
        return code if released else code or 1
    finally:
        close_world()
