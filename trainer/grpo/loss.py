"""The GRPO loss of the INTELLECT-2 recipe: token-level normalisation and two-sided ratio clipping.

Per completion token t with advantage A (the sample's group-normalised reward) and ratio
r = exp(logp_new - logp_old), the objective maximised is

    J_t = min( min(r, delta) * A,  clip(r, 1 - eps_low, 1 + eps_high) * A )

and the loss is -sum_t J_t / N where N is the number of completion tokens in the whole (mini-)batch, not
a mean of per-sample means (so long samples weigh per token what short ones do).

Sources followed (formula only; the code is ours):
- INTELLECT-2 technical report, section 4.1 "two-sided GRPO clipping": PPO's min() leaves the term for
  A < 0 unbounded as r grows, so one update on a token the new policy already made far likelier can be
  huge; bounding the ratio by delta (> 1 + eps_high; the report uses delta = 4, eps = 0.2) caps it.
- prime-rl at the INTELLECT-2 release (src/zeroband/training/loss.py, grpo_loss_clip): the ratio is first
  clamped to [0, delta], then clipped to [1 - eps_low, 1 + eps_high], and the loss is the max of the two
  negated terms; TRL's GRPOTrainer `delta` option (documented as "delta in section 4.1 of the paper") does
  the same. For A > 0 the delta bound never binds because min() already takes the 1 + eps_high branch.

Branches where the objective is flat in r (no gradient), reported as clip fractions:
- "high":  A > 0 and r > 1 + eps_high (PPO's usual upper clip);
- "low":   A < 0 and r < 1 - eps_low (PPO's usual lower clip);
- "delta": A < 0 and r > delta (the INTELLECT-2 addition).

Negative advantages can be down-weighted (`negative_weight` w in [0, 1], default 1 = the recipe): A is
replaced by w * A where A < 0 before the objective above. On a small model whose wrong completions are
longer than its right ones and share their first tokens, the token-level sum of negative terms outweighs
the positive ones on the shared prefix and pushes correct answers down with the wrong ones ("likelihood
displacement"); w < 1 keeps the positive signal dominant (w = 0 is filtered behaviour cloning of the
better-than-average samples, as in RAFT / expert iteration). docs/trainer.md ("Does it learn?") has the
measurements.

Optional terms, normalised by the same N:
- KL to a frozen reference with Schulman's k3 estimator, k3 = exp(x) - x - 1 with x = logp_ref - logp_new:
  an unbiased, always non-negative estimate of KL(pi_new || pi_ref) for tokens sampled from pi_new
  ("Approximating KL divergence", J. Schulman 2020; the estimator prime-rl and TRL use);
- an entropy bonus, -entropy_coef * H_t, where H_t is the entropy of the next-token distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..errors import TrainerError

# exp() of a log-ratio beyond +-20 is already clipped in every branch (delta <= 1000 < e^20 and
# 1 - eps_low > e^-20); clamping first keeps exp finite so backward never computes 0 * inf = nan.
_MAX_ABS_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossParams:
    """The loss's hyper-parameters (a view of TrainerSettings; see trainer/grpo/config.py for bounds)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    delta: float = 4.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    negative_weight: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise TrainerError(f"clip range [1 - {self.eps_low}, 1 + {self.eps_high}] is empty or negative")
        if self.delta <= 1.0 + self.eps_high:
            raise TrainerError(f"delta {self.delta} must exceed 1 + eps_high = {1.0 + self.eps_high}")
        if self.kl_coef < 0.0 or self.entropy_coef < 0.0:
            raise TrainerError("kl_coef and entropy_coef must be non-negative")
        if not 0.0 <= self.negative_weight <= 1.0:
            raise TrainerError(f"negative_weight must lie in [0, 1], got {self.negative_weight}")


@dataclass
class LossMetrics:
    """Sums over loss tokens, so micro-batches merge exactly; `means()` divides by `tokens`."""

    tokens: float = 0.0
    policy_loss: float = 0.0  # sum of -J_t
    ratio: float = 0.0
    clip_low: float = 0.0
    clip_high: float = 0.0
    clip_delta: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0

    def merge(self, other: LossMetrics) -> LossMetrics:
        return LossMetrics(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def means(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        out = {f.name: getattr(self, f.name) / n for f in fields(self) if f.name != "tokens"}
        out["clip_fraction"] = out["clip_low"] + out["clip_high"] + out["clip_delta"]
        out["tokens"] = self.tokens
        return out


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # scalar with gradient; already divided by the normaliser
    metrics: LossMetrics


def k3_kl(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_new || pi_ref): exp(x) - x - 1, x = logp_ref - logp_new."""
    x = (logp_ref - logp_new).clamp(-_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)
    return torch.exp(x) - x - 1.0


def grpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    params: LossParams,
    *,
    normalizer: float | None = None,
    logp_ref: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> LossOutput:
    """The loss of one (micro-)batch; every tensor has the same shape, one entry per token position.

    `loss_mask` is True on completion tokens. `normalizer` is the number of completion tokens in the whole
    batch the optimizer step covers (defaults to this call's own count): with micro-batches, each call
    divides by the batch total, so the summed gradients equal those of one call on the whole batch.
    `logp_ref` is required when params.kl_coef > 0, `entropy` when params.entropy_coef > 0.
    """
    shape = logp_new.shape
    for name, t in (("logp_old", logp_old), ("advantages", advantages), ("loss_mask", loss_mask)):
        if t.shape != shape:
            raise TrainerError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp_new")
    if params.kl_coef > 0.0 and logp_ref is None:
        raise TrainerError(
            "kl_coef > 0 needs reference log-probs (logp_ref); set kl_coef = 0 to run without one"
        )
    if params.entropy_coef > 0.0 and entropy is None:
        raise TrainerError("entropy_coef > 0 needs per-token entropies; compute them with the new log-probs")
    mask = loss_mask.to(logp_new.dtype)
    count = float(mask.sum().item())
    norm = count if normalizer is None else float(normalizer)
    if not norm > 0.0:
        raise TrainerError(f"loss normaliser must be a positive token count, got {norm}")

    log_ratio = (logp_new - logp_old.detach()).clamp(-_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(logp_new.dtype)
    if params.negative_weight != 1.0:
        adv = torch.where(adv < 0, adv * params.negative_weight, adv)
    bounded = torch.clamp(ratio, max=params.delta)
    clipped = torch.clamp(ratio, 1.0 - params.eps_low, 1.0 + params.eps_high)
    objective = torch.minimum(bounded * adv, clipped * adv)
    per_token = -objective

    kl_sum = torch.zeros((), dtype=logp_new.dtype)
    if logp_ref is not None:
        kl_tok = k3_kl(logp_new, logp_ref.detach())
        kl_sum = (kl_tok * mask).sum()
        if params.kl_coef > 0.0:
            per_token = per_token + params.kl_coef * kl_tok
    ent_sum = torch.zeros((), dtype=logp_new.dtype)
    if entropy is not None:
        if entropy.shape != shape:
            raise TrainerError(f"entropy has shape {tuple(entropy.shape)}, expected {tuple(shape)}")
        ent_sum = (entropy * mask).sum()
        if params.entropy_coef > 0.0:
            per_token = per_token - params.entropy_coef * entropy

    loss = (per_token * mask).sum() / norm

    with torch.no_grad():
        r = ratio.detach()
        on = loss_mask.bool()
        metrics = LossMetrics(
            tokens=count,
            policy_loss=float((-objective.detach() * mask).sum()),
            ratio=float((r * mask).sum()),
            clip_low=float((on & (adv < 0) & (r < 1.0 - params.eps_low)).sum()),
            clip_high=float((on & (adv > 0) & (r > 1.0 + params.eps_high)).sum()),
            clip_delta=float((on & (adv < 0) & (r > params.delta)).sum()),
            kl=float(kl_sum.detach()),
            entropy=float(ent_sum.detach()),
        )
    if not math.isfinite(float(loss.detach())):
        raise TrainerError("GRPO loss is not finite: check for NaN log-probs or advantages in this batch")
    return LossOutput(loss=loss, metrics=metrics)
