"""The devnet's cheating pipeline stages (`prime-node devnet --pipeline`): what a `start --pipeline` node run by
node/cli/adversary.py does in place of honest work. Each docstring names what catches it (docs/pipeline.md).

They are hooks of the pipeline node (node/contributor/pipeline_stage.py `PipelineStage.load_stage` and
`tamper`), and the same adversaries as tests/support/pipeline_attacks.py's "weights" and "send-uncommitted"
kinds; production nodes never load this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...node.pipeline.driver import Tamper
from ...node.pipeline.stage import Outgoing
from ...node.pipeline.stage_model import StageModel
from ...p2p.pipeline.layout import StageLayout

# Relative weight noise on the stage's layers: far above what the boundary commitments tolerate (1e-3 is caught
# at 2.3-4x the bound, docs/pipeline.md "Calibration"), so every batch it takes part in fails.
STAGE_PERTURBATION = 1e-2
NOISE = 0.05  # of the tensor's standard deviation, added to the activations sent


def perturb_stage_(model: StageModel, relative: float, seed: int) -> StageModel:
    """Multiply every parameter of the stage's decoder layers by (1 + relative * N(0, 1)), in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.layers.parameters():
            parameter.mul_(
                1 + relative * torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
            )
    return model


def perturbed_stage(checkpoint: Path, layout: StageLayout, stage: int) -> StageModel:
    """Loads its stage and perturbs its layers' weights (a cheaper or tampered copy of the claimed model), then
    computes and commits consistently with them: its own boundary's recomputation in verify_group (`pipeline`,
    the stage blamed; its group's other members excused)."""
    return perturb_stage_(StageModel.load(checkpoint, layout, stage), STAGE_PERTURBATION, seed=stage + 1)


def uncommitted_activations(seed: int = 0) -> Tamper:
    """Sends each batch's first prefill with noise added to the tensor while the frame keeps the commitment of
    the honest one: its successor finds the frame's tensor belying the signed commitment and hands in a fraud
    report (`check_fraud`: the sender blamed, `pipeline`). Only a stage that sends activations can do it, so
    this adversary offers stage 0 alone (a last stage sends tokens)."""

    def tamper(_stage: int, out: Outgoing) -> Outgoing:
        if out.kind != "prefill" or out.micro_batch != 0:
            return out
        noise = torch.randn(out.tensor.shape, generator=torch.Generator().manual_seed(seed))
        return dataclasses.replace(out, tensor=out.tensor + NOISE * out.tensor.std() * noise)

    return tamper


@dataclass(frozen=True)
class StageAttack:
    load_stage: Callable[[Path, StageLayout, int], StageModel] = StageModel.load
    tamper: Tamper | None = None
    stages: tuple[int, ...] | None = None  # the stages it offers; None: every stage


# In the order `--adversaries N` takes them in a pipeline devnet.
PIPELINE_ATTACKS: dict[str, StageAttack] = {
    "stage-weights": StageAttack(load_stage=perturbed_stage),
    "stage-uncommitted": StageAttack(tamper=uncommitted_activations(), stages=(0,)),
}
# The check that rejects each (the blamed stage's verdict; docs/devnet.md).
PIPELINE_EXPECTED_CHECKS: dict[str, frozenset[str]] = {
    kind: frozenset({"pipeline"}) for kind in PIPELINE_ATTACKS
}
