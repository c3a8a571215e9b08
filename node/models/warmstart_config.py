"""The warm start's settings, kept apart from the training code so that loading them (every CLI start-up)
does not import torch and transformers."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..environments.arithmetic import ArithmeticConfig, ArithmeticEnvironment


class WarmStartConfig(BaseModel):
    """How the warm start trains and evaluates; the defaults are what `prime-node model init` uses."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(
        600, ge=0, le=1_000_000, description="Optimizer steps of supervised training (0: none)."
    )
    batch_size: int = Field(64, ge=1, le=4096, description="Problems per optimizer step.")
    lr: float = Field(3e-3, gt=0, le=1.0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(
        50, ge=0, description="Steps of linear learning-rate warm-up before cosine decay."
    )
    weight_decay: float = Field(0.01, ge=0, le=1.0, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    task_seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the arithmetic task set trained on.")
    # A curriculum: training leans on the easy levels, which a model this small learns within the time
    # budget; held-out problems follow the run's default mix, so the accuracy reported is the one RL starts
    # from, with the harder levels left for RL to improve.
    train_level_weights: tuple[int, int, int, int, int] = Field(
        (6, 3, 1, 0, 0), description="Relative frequency of difficulty levels 1..5 in training."
    )
    eval_level_weights: tuple[int, int, int, int, int] = Field(
        ArithmeticConfig().level_weights,
        description="Relative frequency of levels 1..5 among held-out problems.",
    )
    eval_size: int = Field(1000, ge=1, le=100_000, description="Held-out problems scored after training.")
    # 0 keeps the original split by index (and the embedded model's weights); benchmarks/learning.py sets it.
    heldout_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Share of prompt texts held out by content (node/environments/split.py): never trained on, "
        "and the only ones evaluated. 0: the last eval_size indices are held out (by index only).",
    )
    eval_max_new_tokens: int = Field(
        8, ge=1, le=64, description="Greedy decoding budget per held-out problem."
    )
    threads: int = Field(
        1, ge=1, le=256, description="torch CPU threads; the weights' hash can depend on it."
    )

    def train_tasks(self) -> ArithmeticEnvironment:
        return ArithmeticEnvironment(
            ArithmeticConfig(seed=self.task_seed, level_weights=self.train_level_weights)
        )

    def eval_tasks(self) -> ArithmeticEnvironment:
        return ArithmeticEnvironment(
            ArithmeticConfig(seed=self.task_seed, level_weights=self.eval_level_weights)
        )
