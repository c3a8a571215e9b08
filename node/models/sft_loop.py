"""The one supervised fine-tuning loop: the arithmetic warm start, the warm start on any environment and
`prime-node sft` (SFT on a verified dataset) all step through it.

AdamW (betas 0.9, 0.98), linear warm-up then cosine decay to 10% of the peak rate, gradient-norm clipping,
the loss of transformers' causal LM over labelled positions only. The order of operations is fixed (zero the
gradients, backward, clip, step, schedule), so a run is deterministic under deterministic_torch, and one
resumed from a saved state (`state_dict` / `load_state_dict`) takes exactly the steps the uninterrupted run
would have taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from ..errors import ModelError

RECENT = 20  # steps the reported loss averages over


def lr_factor(step: int, warmup_steps: int, steps: int) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from the peak down to 10% at `steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class RecipeFields(Protocol):
    """What every SFT configuration (warm starts, `prime-node sft`) says about the optimisation."""

    @property
    def steps(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def grad_clip(self) -> float: ...


@dataclass(frozen=True)
class SftRecipe:
    steps: int
    lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float

    @classmethod
    def of(cls, config: RecipeFields) -> SftRecipe:
        return cls(config.steps, config.lr, config.warmup_steps, config.weight_decay, config.grad_clip)


class SftLoop:
    """Model, optimizer and schedule of one SFT run; `run` trains from `step` up to the recipe's steps."""

    def __init__(self, model: PreTrainedModel, recipe: SftRecipe) -> None:
        self.model, self.recipe = model, recipe
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=recipe.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, recipe.warmup_steps, recipe.steps)
        )
        self.step = 0
        self.recent: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        """Everything but the weights a resumed run needs (the weights are saved as safetensors)."""
        return {
            "step": self.step,
            "recent": list(self.recent),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.recent = [float(x) for x in state["recent"]]

    def run(
        self,
        batches: Iterable[dict[str, torch.Tensor]],
        after_step: Callable[[SftLoop], None] | None = None,
    ) -> float | None:
        """Train on `batches` (those of steps `self.step`, `self.step + 1`, ...) until the recipe's last step;
        `after_step` sees the loop after each. The mean loss of the last RECENT steps (None: no step)."""
        self.model.train()
        for batch in batches:
            if self.step >= self.recipe.steps:
                break
            loss = self.model(**batch).loss
            if not torch.isfinite(loss):
                raise ModelError(
                    f"supervised training diverged at step {self.step} (loss {loss.item()}); lower lr"
                )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.recent = (self.recent + [loss.item()])[-RECENT:]
            self.step += 1
            if after_step is not None:
                after_step(self)
        self.model.eval()
        return self.mean_loss

    @property
    def mean_loss(self) -> float | None:
        return sum(self.recent) / len(self.recent) if self.recent else None
