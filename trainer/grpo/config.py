"""The GRPO recipe's hyper-parameters as one typed settings section.

Defaults follow the INTELLECT-2 report (section 4.1: epsilon 0.2, delta 4, KL coefficient 0.001, aggressive
gradient-norm clipping, async level 2) except where the embedded tiny model needs otherwise (learning rate,
batch size, token budgets); docs/trainer.md explains each field. `prime-node trainer` nests this section in
its command settings, so every field is settable from TOML, `PRIME_NODE_TRAINER__<FIELD>` or a flag.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from ...node.config import Section


class TrainerSettings(Section):
    """What the trainer computes; infrastructure (ports, peers, paths) lives in the command's settings."""

    # --- the loss (trainer/grpo/loss.py) ---
    eps_low: float = Field(
        0.2, ge=0.0, lt=1.0, description="Ratio clip below: ratios under 1 - eps_low stop pushing down."
    )
    eps_high: float = Field(
        0.2, ge=0.0, le=10.0, description="Ratio clip above: ratios over 1 + eps_high stop pushing up."
    )
    delta: float = Field(
        4.0,
        gt=1.0,
        le=1000.0,
        description="Upper bound on the ratio for negative advantages (two-sided clipping).",
    )
    kl_coef: float = Field(
        0.001,
        ge=0.0,
        le=10.0,
        description="Weight of the k3 KL estimate to the frozen reference; 0 turns it off.",
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, le=1.0, description="Weight of the entropy bonus; 0 turns it off."
    )
    negative_weight: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Weight of tokens with negative advantages (1: the INTELLECT-2 recipe; 0: learn only "
        "from better-than-average samples). See docs/trainer.md, 'Does it learn?' (4).",
    )
    temperature: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description="Sampling temperature of the rollouts; logits are divided by it. `prime-node trainer` sets "
        "it from run.temperature (not a setting of its own).",
    )

    # --- advantages (trainer/grpo/advantages.py); the length reward is a run parameter (run.length_targets) ---
    advantage_eps: float = Field(
        1e-6, gt=0.0, le=1.0, description="Added to a group's reward std before dividing (avoids 0/0)."
    )

    # --- batches (trainer/service/batch_buffer.py, trainer/grpo/packing.py) ---
    async_level: int = Field(
        2, ge=0, le=64, description="Oldest usable rollout policy, in steps behind the policy being trained."
    )
    batch_size: int = Field(64, ge=1, le=1_000_000, description="Samples (completions) per rollout step.")
    micro_batch_tokens: int = Field(
        1024,
        ge=16,
        le=1_048_576,
        description="Tokens per packed row; the longest prompt+completion must fit.",
    )
    max_buffered_samples: int = Field(
        65_536,
        ge=1,
        description="Samples held waiting for a batch; beyond it new rollout files wait on disk.",
    )

    # --- optimisation (trainer/grpo/schedule.py) ---
    lr: float = Field(1e-4, gt=0.0, le=1.0, description="Peak AdamW learning rate (reached after warmup).")
    warmup_steps: int = Field(
        10, ge=0, le=1_000_000, description="Optimizer steps of linear learning-rate warmup."
    )
    decay_steps: int = Field(
        0,
        ge=0,
        le=100_000_000,
        description="Optimizer step at which a linear decay after warmup reaches min_lr_ratio x lr; "
        "0 keeps the peak lr (an open-ended run).",
    )
    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Learning rate at the end of the decay, as a fraction of lr."
    )
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW first-moment decay.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW second-moment decay.")
    grad_clip: float = Field(0.1, gt=0.0, le=1000.0, description="Global gradient-norm clipping threshold.")
    optimizer_steps_per_batch: int = Field(
        2,
        ge=1,
        le=64,
        description="Optimizer steps per rollout step; the batch is split into this many parts.",
    )
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the trainer's own randomness.")

    @model_validator(mode="after")
    def _check_recipe(self) -> TrainerSettings:
        # delta only bites when it is above the upper clip; below it would clip inside the trust region.
        if self.delta <= 1.0 + self.eps_high:
            raise ValueError(f"delta ({self.delta}) must exceed 1 + eps_high ({1.0 + self.eps_high})")
        if self.batch_size < self.optimizer_steps_per_batch:
            raise ValueError(
                "batch_size must be at least optimizer_steps_per_batch (each step needs samples)"
            )
        return self
