"""AdamW with linear warmup, aggressive gradient-norm clipping, and several optimizer steps per rollout step.

INTELLECT-2 (section 4.1) found gradient-norm spikes preceded its instabilities and clipped the global norm
hard (0.05-0.1); a step whose gradient is not finite is skipped, not applied, so one bad batch cannot
poison the weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..errors import TrainerError
from .config import TrainerSettings

Item = TypeVar("Item")


def build_optimizer(model: torch.nn.Module, settings: TrainerSettings) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainerError("the model has no trainable parameters")
    return torch.optim.AdamW(
        params,
        lr=settings.lr,
        betas=(settings.adam_beta1, settings.adam_beta2),
        weight_decay=settings.weight_decay,
    )


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): (step + 1) / warmup, then 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def lr_factor(step: int, warmup_steps: int, decay_steps: int = 0, min_ratio: float = 0.1) -> float:
    """Warmup, then either the peak (decay_steps = 0) or a linear decay from the peak at the end of the
    warmup to `min_ratio` at optimizer step `decay_steps`, held after it.

    A finite run wants the decay: at a constant lr the tiny model's greedy answers keep flipping between
    nearly tied candidates from one step to the next (docs/trainer.md, "Does it learn?").
    """
    factor = warmup_factor(step, warmup_steps)
    if decay_steps <= 0 or step < warmup_steps:
        return factor
    span = max(decay_steps - warmup_steps, 1)
    progress = min(1.0, (step - warmup_steps) / span)
    return factor * (1.0 - (1.0 - min_ratio) * progress)


def build_scheduler(
    optimizer: torch.optim.Optimizer, settings: TrainerSettings
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup, decay, floor = settings.warmup_steps, settings.decay_steps, settings.min_lr_ratio
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup, decay, floor))


@dataclass(frozen=True)
class StepResult:
    grad_norm: float  # global L2 norm before clipping
    lr: float  # learning rate the step used
    skipped: bool  # True when the gradient was not finite and nothing was applied


def apply_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_grad_norm: float,
) -> StepResult:
    """Clip the accumulated gradients, step the optimizer and the schedule, and zero the gradients."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        raise TrainerError("no gradients to apply: the batch had no loss tokens or backward() was not called")
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    lr = float(optimizer.param_groups[0]["lr"])
    skipped = not math.isfinite(norm)
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(grad_norm=norm, lr=lr, skipped=skipped)


def split_evenly(items: Sequence[Item], parts: int) -> list[list[Item]]:
    """`parts` consecutive chunks, sizes differing by at most one (the optimizer steps of a rollout step)."""
    if parts < 1 or parts > len(items):
        raise TrainerError(f"cannot split {len(items)} samples into {parts} optimizer steps")
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for k in range(parts):
        size = base + (1 if k < extra else 0)
        out.append(list(items[start : start + size]))
        start += size
    return out
