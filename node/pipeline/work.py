"""What one group generates for one batch, as every member derives it: the requests and the schedule.

Every stage holds the same `PipelineWork` (the assignment comes from the group and batch, not from any
member), so each can check that the rows a peer sends belong where the schedule puts them, and none needs
prompts or seeds from a peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ...proofs.pipeline.schedule import micro_batches
from ..engine.types import SampleRequest, SamplingParams


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


def real_rows(states: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The unpadded rows of a left-padded (B, L, H) prefill tensor, sample after sample: (sum(lengths), H)."""
    width = states.shape[1]
    return torch.cat([states[b, width - int(n) :] for b, n in enumerate(lengths)])
