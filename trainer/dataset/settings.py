"""Typed settings of `prime-node dataset build` (flags > env PRIME_NODE_* > TOML --config > defaults)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, StringConstraints, field_validator

from ...node.config import CommonSettings, Section
from ...node.run.settings import RunSettings
from ...p2p.names import MODEL_LABEL_PATTERN
from ...p2p.wire import NodeId
from .difficulty import DEFAULT_KS, MAX_K
from .subsets import SftBands

# LABEL=DIR: another dataset directory (built from an annotating model's synthetic run) whose verified rows
# annotate difficulty under LABEL.
Annotation = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}=.+$", max_length=4096)
]


class DatasetSection(Section):
    """Where the run's verified work is, who is trusted, and what the dataset keeps."""

    ledgers: list[Path] = Field(
        default_factory=list,
        max_length=64,
        description="Validator ledgers (<validator data-dir>/ledger.sqlite).",
    )
    accepted_dir: Path | None = Field(
        None, description="The accepted files (the trainer's <data-dir>/accepted)."
    )
    weights_dir: Path | None = Field(
        None, description="The trainer's published checkpoints (<data-dir>/weights)."
    )
    validator_keys: list[NodeId] = Field(
        default_factory=list, max_length=64, description="Validator public keys whose verdicts are trusted."
    )
    operator_key: NodeId | None = Field(
        None, description="The operator's public key, which signs the checkpoint manifests."
    )
    model_label: str | None = Field(
        None, pattern=MODEL_LABEL_PATTERN, description="Label of the generating model; default the run id."
    )
    correct_threshold: float = Field(
        1.0, gt=0, le=1, description="A row is correct when its recomputed task reward reaches this."
    )
    pass_k: list[Annotated[int, Field(ge=1, le=MAX_K)]] = Field(
        default_factory=lambda: list(DEFAULT_KS), min_length=1, max_length=16, description="The k of pass@k."
    )
    annotations: list[Annotation] = Field(
        default_factory=list,
        max_length=8,
        description="LABEL=DIR: a dataset built from an annotating model's run, adding its pass@k columns.",
    )
    band_model: str | None = Field(
        None,
        pattern=MODEL_LABEL_PATTERN,
        description="Model whose pass rate the SFT band reads; default ours.",
    )
    sft: SftBands = Field(default_factory=SftBands, description="Bands of the SFT subset.")

    @field_validator("pass_k")
    @classmethod
    def _distinct(cls, ks: list[int]) -> list[int]:
        if len(set(ks)) != len(ks):
            raise ValueError("pass_k repeats a k")
        return sorted(ks)


class DatasetBuildSettings(CommonSettings):
    run: RunSettings = Field(default_factory=RunSettings, description="The run's parameters (env, run id).")
    dataset: DatasetSection = Field(default_factory=DatasetSection, description="Inputs and subsets.")
