"""One rollout step of training: old log-probs from the trainer's own weights, then k optimizer steps.

The log-probs of the policy that generated the data are recomputed here at the start of the step with the
trainer's weights (INTELLECT-2 section 2.1); the node's own numbers are never trusted. The batch is split
into `optimizer_steps_per_batch` parts; each part is packed into micro-batches whose losses are normalised
by the part's total completion tokens and accumulated before one clipped AdamW step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import TrainerError
from .config import TrainerSettings
from .loss import LossMetrics, LossParams, grpo_loss
from .packing import PackedRows, TrainSample, pack_samples, token_logprobs
from .schedule import StepResult, apply_step, split_evenly


def loss_params(settings: TrainerSettings) -> LossParams:
    return LossParams(
        eps_low=settings.eps_low,
        eps_high=settings.eps_high,
        delta=settings.delta,
        kl_coef=settings.kl_coef,
        entropy_coef=settings.entropy_coef,
        negative_weight=settings.negative_weight,
    )


@dataclass(frozen=True)
class PreparedPart:
    """One optimizer step's data: packed micro-batches with the fixed log-probs they are compared to."""

    rows: list[PackedRows]
    logp_old: list[torch.Tensor]
    logp_ref: list[torch.Tensor] | None
    loss_tokens: int  # completion tokens: the loss normaliser of this optimizer step
    tokens: int  # prompt + completion tokens, padding excluded (for tokens/s)


@dataclass(frozen=True)
class RolloutStepReport:
    loss: LossMetrics  # summed over every micro-batch of every optimizer step
    steps: list[StepResult]
    tokens: int  # prompt + completion tokens trained on, padding excluded
    seconds: float

    def summary(self) -> dict[str, float]:
        out = self.loss.means()
        applied = [s for s in self.steps if not s.skipped]
        out["grad_norm"] = max((s.grad_norm for s in self.steps), default=0.0)
        out["lr"] = self.steps[-1].lr if self.steps else 0.0
        out["skipped_steps"] = float(len(self.steps) - len(applied))
        out["tokens_per_s"] = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return out


@torch.no_grad()
def _fixed_logprobs(model: torch.nn.Module, rows: list[PackedRows], temperature: float) -> list[torch.Tensor]:
    was_training = model.training
    model.eval()  # no dropout: the reference point must be the policy itself
    try:
        return [token_logprobs(model, r, temperature)[0].detach() for r in rows]
    finally:
        model.train(was_training)


def prepare_parts(
    model: torch.nn.Module,
    samples: Sequence[TrainSample],
    settings: TrainerSettings,
    pad_id: int,
    reference: torch.nn.Module | None = None,
    select: Callable[[list[PackedRows]], list[PackedRows]] | None = None,
) -> list[PreparedPart]:
    """Split, pack, and compute old (and reference) log-probs for every part BEFORE any weight changes.

    `select` keeps a subset of each part's micro-batches (FSDP: this rank's share, trainer/grpo/fsdp.py); the
    loss normaliser and token count stay those of the whole part."""
    if settings.kl_coef > 0.0 and reference is None:
        raise TrainerError("kl_coef > 0 needs a frozen reference model; pass one or set kl_coef = 0")
    parts = []
    for chunk in split_evenly(samples, settings.optimizer_steps_per_batch):
        rows = pack_samples(chunk, settings.micro_batch_tokens, pad_id)
        loss_tokens = sum(r.loss_tokens for r in rows)
        if select is not None:
            rows = select(rows)
        parts.append(
            PreparedPart(
                rows=rows,
                logp_old=_fixed_logprobs(model, rows, settings.temperature),
                logp_ref=(
                    _fixed_logprobs(reference, rows, settings.temperature)
                    if settings.kl_coef > 0.0 and reference is not None
                    else None
                ),
                loss_tokens=loss_tokens,
                tokens=sum(len(s) for s in chunk),
            )
        )
    return parts


def part_loss(
    model: torch.nn.Module, part: PreparedPart, settings: TrainerSettings, *, backward: bool
) -> tuple[float, LossMetrics]:
    """Loss of one part (sum of its micro-batch losses), calling backward per micro-batch when asked."""
    params = loss_params(settings)
    want_entropy = True  # cheap next to the forward; always reported as a metric
    total, metrics = 0.0, LossMetrics()
    for i, rows in enumerate(part.rows):
        logp_new, entropy = token_logprobs(model, rows, settings.temperature, with_entropy=want_entropy)
        out = grpo_loss(
            logp_new,
            part.logp_old[i],
            rows.advantages.to(logp_new.device),
            rows.loss_mask.to(logp_new.device),
            params,
            normalizer=part.loss_tokens,
            logp_ref=part.logp_ref[i] if part.logp_ref is not None else None,
            entropy=entropy,
        )
        if backward:
            out.loss.backward()  # per micro-batch, so only one micro-batch's activations are alive
        total += float(out.loss.detach())
        metrics = metrics.merge(out.metrics)
    return total, metrics


def train_rollout_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    samples: Sequence[TrainSample],
    settings: TrainerSettings,
    pad_id: int,
    reference: torch.nn.Module | None = None,
    select: Callable[[list[PackedRows]], list[PackedRows]] | None = None,
) -> RolloutStepReport:
    """Train on one batch: prepare every part first, then one clipped AdamW step per part.

    With `select` (FSDP, trainer/grpo/fsdp.py) this process trains its share of each part's micro-batches and the
    report's loss metrics are its share's."""
    started = time.perf_counter()
    parts = prepare_parts(model, samples, settings, pad_id, reference, select)
    model.train()
    metrics, steps, tokens = LossMetrics(), [], 0
    for part in parts:
        _, part_metrics = part_loss(model, part, settings, backward=True)
        steps.append(apply_step(model, optimizer, scheduler, settings.grad_clip))
        metrics = metrics.merge(part_metrics)
        tokens += part.tokens
    return RolloutStepReport(loss=metrics, steps=steps, tokens=tokens, seconds=time.perf_counter() - started)
