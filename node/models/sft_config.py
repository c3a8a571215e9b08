"""The settings of `prime-node sft`, kept apart from the training code so that building the command line
(every CLI start-up) imports neither torch nor transformers."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ..config import CommonSettings


class SftConfig(BaseModel):
    """How `prime-node sft` trains."""

    steps: int = Field(300, ge=1, le=1_000_000, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, le=4096, description="Samples per optimizer step.")
    lr: float = Field(1e-3, gt=0, le=1.0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(
        20, ge=0, description="Steps of linear learning-rate warm-up before cosine decay."
    )
    weight_decay: float = Field(0.01, ge=0, le=1.0, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    seed: int = Field(0, ge=0, lt=2**63, description="Seed of the data order.")
    save_every: int = Field(50, ge=1, description="Steps between resumable states.")
    threads: int = Field(1, ge=1, le=256, description="torch CPU threads; the weights can depend on it.")


class SftSettings(CommonSettings):
    sft: SftConfig = Field(default_factory=SftConfig, description="The recipe.")
