"""What one group generates for one batch, as every member derives it: the requests and the schedule.

Every stage holds the same `PipelineWork` (`work_for`: the assignment comes from the group id and batch through
proofs/assignment.py, not from any member), so each can check that the rows a peer sends belong where the
schedule puts them, none needs prompts or seeds from a peer, and the validator derives the same work to check
the group's files against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ...p2p.pipeline.frames import FrameShapes, WireDtype
from ...p2p.pipeline.layout import StageLayout
from ...proofs.assignment import Assignment, assign
from ...proofs.pipeline.schedule import micro_batches
from ..engine.types import SampleRequest, SamplingParams
from ..run.settings import RunSettings
from ..run.validation import RunTasks


@dataclass(frozen=True)
class PipelineWork:
    requests: tuple[SampleRequest, ...]
    params: SamplingParams
    micro_batch_size: int
    eos_token_id: int
    pad_token_id: int

    def __post_init__(self) -> None:
        if not self.requests or self.micro_batch_size < 1:
            raise ValueError("a pipelined batch needs at least one request and micro_batch_size >= 1")

    @cached_property
    def schedule(self) -> list[list[int]]:
        return micro_batches([len(r.prompt_ids) for r in self.requests], self.micro_batch_size)

    def prompt_lengths(self, rows: Sequence[int]) -> torch.Tensor:
        return torch.tensor([len(self.requests[i].prompt_ids) for i in rows])

    def left_padded(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask) of the rows' prompts, left-padded as HFEngine pads them."""
        prompts = [self.requests[i].prompt_ids for i in rows]
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            ids[b, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[b, longest - len(prompt) :] = 1
        return ids, mask


def frame_shapes(work: PipelineWork, hidden_size: int, activation_dtype: WireDtype) -> FrameShapes:
    """What each frame of a stream of this batch may declare (every hop: prefill and decode activations of
    `hidden_size` in `activation_dtype`, tokens in int64), held against its header before its tensor is read."""
    return FrameShapes(
        hidden_size,
        activation_dtype,
        tuple((tuple(rows), max(len(work.requests[r].prompt_ids) for r in rows)) for rows in work.schedule),
        len(work.requests),
        work.params.max_new_tokens,
    )


def real_rows(states: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The unpadded rows of a left-padded (B, L, H) prefill tensor, sample after sample: (sum(lengths), H)."""
    width = states.shape[1]
    return torch.cat([states[b, width - int(n) :] for b, n in enumerate(lengths)])


@dataclass(frozen=True)
class GroupBatch:
    """Which batch of which group, and how it is cut: what `work_for` needs beyond the run."""

    group_id: (
        str  # 64 hex digits: GroupSpec.group_id (a digest of run, policy step, members, layout and nonce)
    )
    policy_step: int
    batch: int  # the group's batch counter at that step
    prompts: int  # problems in the batch (each with the run's `samples` completions)
    micro_batch_size: int

    @classmethod
    def pinned(cls, layout: StageLayout, group_id: str, policy_step: int, batch: int) -> GroupBatch:
        """Batch `batch` of a group in the shape the run pins (`layout.prompts`, `layout.micro_batch_size`):
        what members derive their work from, and the validator what it holds their files to. Never a member's
        own settings: two honest members cutting otherwise would disagree on every frame."""
        return cls(group_id, policy_step, batch, layout.prompts, layout.micro_batch_size)

    def pinned_difference(self, layout: StageLayout) -> str | None:
        """None when this (claimed) batch has the run's pinned shape; else what differs, both values named."""
        found = [
            f"{name} {ours}, the run's {theirs}"
            for name, ours, theirs in (
                ("prompts", self.prompts, layout.prompts),
                ("micro_batch_size", self.micro_batch_size, layout.micro_batch_size),
            )
            if ours != theirs
        ]
        return "; ".join(found) or None


def work_for(
    run: RunSettings, tasks: RunTasks, batch: GroupBatch, *, eos_token_id: int, pad_token_id: int
) -> tuple[PipelineWork, Assignment]:
    """The work of a group's batch, as every member and the validator derive it: the problems and seeds of
    `assign(..., group=True)` over the run's tasks (rows in assignment order), sampled with the run's settings."""
    assignment = assign(
        run.run_seed,
        batch.group_id,
        batch.policy_step,
        batch.batch,
        task_count=tasks.task_count,
        prompts=batch.prompts,
        samples=run.samples,
        group=True,
    )
    requests = tuple(
        SampleRequest(prompt_ids=tasks.prompt_ids(index, seed), seed=seed)
        for index, seed in assignment.rows()
    )
    params = SamplingParams(run.max_new_tokens, run.temperature)
    work = PipelineWork(requests, params, batch.micro_batch_size, eos_token_id, pad_token_id)
    return work, assignment
