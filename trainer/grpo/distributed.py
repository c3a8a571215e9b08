"""The trainer's process group under torchrun: who is who, and rank 0's commands to the other ranks.

With `prime-node trainer --fsdp`, torchrun starts one process per GPU. Rank 0 is the trainer service (DHT,
weights server, inbox, consumed record); the other ranks only hold their shard of the model and follow
rank 0's commands: resume from a state, train a batch, stop. Rank 0 sends each batch's content as plain
tensors (token ids, lengths, float64 advantages): never a pickle, and the data is rank 0's own batch of
rollouts that the validator already accepted.

Two process groups: the default one (NCCL on GPUs, gloo on CPU) carries FSDP's collectives with torch's
normal timeout; a gloo "control" group carries the commands with a long timeout, because the other ranks
may legitimately wait hours for rank 0's next batch. A rank that dies is torchrun's business: it ends the
remaining ranks, so no rank waits forever on a dead peer.
"""

from __future__ import annotations

import datetime
import enum
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import TrainerError
from .packing import TrainSample

logger = logging.getLogger(__name__)

# Followers wait for rank 0's next batch on this group; rollouts may take a long time to arrive.
CONTROL_TIMEOUT = datetime.timedelta(days=7)
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    """This process's place in the torchrun job."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> World:
        missing = [name for name in _ENV if name not in os.environ]
        if missing:
            raise TrainerError(
                f"--fsdp needs torchrun's environment ({', '.join(missing)} unset); start the trainer with "
                "`torchrun --nproc-per-node N -m prime_node.node.cli.main trainer --fsdp ...` "
                "(docs/trainer.md, 'Multi-GPU with FSDP2'), or drop --fsdp to train in this one process"
            )
        try:
            world = cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
        except ValueError:
            raise TrainerError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (set by torchrun)") from None
        if not 0 <= world.rank < world.world_size:
            raise TrainerError(f"RANK {world.rank} is outside WORLD_SIZE {world.world_size}")
        return world

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    def bind_device(self) -> None:
        """Select this rank's GPU in the calling thread (the CUDA current device is per thread)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)


class Command(enum.IntEnum):
    RESUME = 1  # argument: the step whose state every rank loads
    TRAIN = 2  # argument: the step being trained; the batch follows, then the state is gathered
    STOP = 3


class Control:
    """Rank 0's command channel to the other ranks, on its own gloo group (CPU tensors only)."""

    def __init__(self, world: World, group: dist.ProcessGroup) -> None:
        self.world = world
        self.group = group

    def _bcast(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=0, group=self.group)
        return tensor

    def send(self, command: Command, argument: int = 0) -> None:
        self._bcast(torch.tensor([int(command), argument], dtype=torch.int64))

    def receive(self) -> tuple[Command, int]:
        header = self._bcast(torch.zeros(2, dtype=torch.int64))
        try:
            return Command(int(header[0])), int(header[1])
        except ValueError:
            raise TrainerError(f"rank 0 sent an unknown command {int(header[0])}") from None

    def send_samples(self, samples: list[TrainSample]) -> None:
        lengths = torch.tensor(
            [[len(s.prompt_ids), len(s.completion_ids)] for s in samples], dtype=torch.int64
        )
        ids = torch.tensor(
            [t for s in samples for t in (*s.prompt_ids, *s.completion_ids)], dtype=torch.int64
        )
        self._bcast(torch.tensor([len(samples), ids.numel()], dtype=torch.int64))
        self._bcast(lengths.reshape(-1, 2))
        self._bcast(ids)
        # float64: the advantages are Python floats, so every rank packs and weighs exactly the same samples.
        self._bcast(torch.tensor([s.advantage for s in samples], dtype=torch.float64))

    def receive_samples(self) -> list[TrainSample]:
        count, total = (int(x) for x in self._bcast(torch.zeros(2, dtype=torch.int64)))
        lengths = self._bcast(torch.zeros((count, 2), dtype=torch.int64)).tolist()
        ids = self._bcast(torch.zeros(total, dtype=torch.int64)).tolist()
        advantages = self._bcast(torch.zeros(count, dtype=torch.float64)).tolist()
        out, start = [], 0
        for (n_prompt, n_completion), advantage in zip(lengths, advantages, strict=True):
            middle, end = start + n_prompt, start + n_prompt + n_completion
            out.append(TrainSample(tuple(ids[start:middle]), tuple(ids[middle:end]), float(advantage)))
            start = end
        if start != total:
            raise TrainerError(f"rank 0 sent {total} token ids but sample lengths that add up to {start}")
        return out


def init_world(world: World) -> Control:
    """Join the torchrun job (NCCL on GPUs, else gloo) and open the control group."""
    backend = "nccl" if world.device.type == "cuda" else "gloo"
    world.bind_device()
    try:
        dist.init_process_group(
            backend=backend,
            rank=world.rank,
            world_size=world.world_size,
            device_id=world.device if backend == "nccl" else None,
        )
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    except (RuntimeError, ValueError) as exc:
        raise TrainerError(f"cannot join the torchrun process group ({backend}): {exc}") from None
    logger.info("rank %d of %d joined (%s, device %s)", world.rank, world.world_size, backend, world.device)
    return Control(world, control)


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
