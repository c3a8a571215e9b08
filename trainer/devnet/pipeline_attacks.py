"""The devnet's cheating pipeline stages (`prime-node devnet --pipeline`): what a `start --pipeline` node run by
node/cli/adversary.py does in place of honest work. Each docstring names what catches it (docs/pipeline.md).

They are hooks of the pipeline node (node/contributor/pipeline_stage.py `PipelineStage.load_stage`,
`measure_throughput` and `tamper`), and the same adversaries as tests/support/pipeline_attacks.py's "weights",
"send-uncommitted" and (in part) "tokens" kinds; production nodes never load this module. `stage-dropout`
cheats no verifier: it leaves mid-batch (node/cli/adversary.py runs it), which nobody is blamed for; the devnet
checks that its group dissolves, nothing of the broken batch is accepted and its group-mate works again
(trainer/devnet/dropout.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...node.pipeline.driver import Tamper
from ...node.pipeline.offer import measure_layer_throughput
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


def substituted_tokens() -> Tamper:
    """The last stage sends, in each batch's tokens frame of micro-batch 0 and step 1, another token for its first
    row than it sampled, while its record keeps the sampled one; stage 0 feeds on the substitute. verify_group
    finds its token frames belying its record ("the tokens it sent at step 1 are not its outputs": the sender
    blamed, `pipeline`). Only the last stage samples, so this adversary offers the devnet's stage 1 alone (the
    devnet cuts the model in two). The variant whose record lists the substitute too (tests/support/
    pipeline_attacks.py "tokens", caught by the Gumbel-argmax recomputation) needs the stage's processor, which
    the node's hooks do not reach."""

    def tamper(_stage: int, out: Outgoing) -> Outgoing:
        if out.kind != "tokens" or out.micro_batch != 0 or out.step != 1:
            return out
        tokens = out.tensor.clone()
        sampled = int(tokens[0])
        tokens[0] = sampled - 1 if sampled > 0 else 1  # another id inside any vocabulary
        return dataclasses.replace(out, tensor=tokens)

    return tamper


@dataclass(frozen=True)
class DropOut:
    """Leave mid-batch, for good: run batches honestly; once `after_batches` of them are done and their files
    handed off (so its honest work is with the validator), in a batch it runs next in a group of the newest
    announced step, as it sends a frame of decode step `at_step` or later, write down the batch and SIGKILL its
    own process group (the node, its DHT
    child and p2pd: a machine that lost power, bar the kernel closing its sockets). A frame of step >= 1 is only
    sent after the successor answered an earlier step of the same batch, so by then the successor has read this
    batch's signed opening and holds a partial record of it. It does not come back."""

    after_batches: int = 2
    at_step: int = 2

    def due(self, batches_done: int, files_pending: int, out: Outgoing) -> bool:
        return batches_done >= self.after_batches and files_pending == 0 and out.step >= self.at_step


# A drop-out claims this many times its measured throughput: the coordinator forms the cheapest groups first, so
# it is always placed in a group (a node that means to break groups would claim speed as well: offers are signed,
# not verified), while a slow honest node is the one left over to regroup with the drop-out's group-mate.
DROPOUT_CLAIMED_SPEEDUP = 100.0


def claims_faster(speedup: float) -> Callable[[StageModel], float]:
    def measure(model: StageModel) -> float:
        return speedup * measure_layer_throughput(model)

    return measure


@dataclass(frozen=True)
class StageAttack:
    load_stage: Callable[[Path, StageLayout, int], StageModel] = StageModel.load
    tamper: Tamper | None = None
    stages: tuple[int, ...] | None = None  # the stages it offers; None: every stage
    measure_throughput: Callable[[StageModel], float] | None = None  # None: the honest measurement
    drop_out: DropOut | None = None  # leaves mid-batch (node/cli/adversary.py DropOutStage)


# In the order `--adversaries N` takes them in a pipeline devnet.
PIPELINE_ATTACKS: dict[str, StageAttack] = {
    "stage-weights": StageAttack(load_stage=perturbed_stage),
    "stage-uncommitted": StageAttack(tamper=uncommitted_activations(), stages=(0,)),
    "stage-tokens": StageAttack(tamper=substituted_tokens(), stages=(1,)),
    "stage-dropout": StageAttack(
        measure_throughput=claims_faster(DROPOUT_CLAIMED_SPEEDUP), drop_out=DropOut()
    ),
}
# The check that rejects each (the blamed stage's verdict; docs/devnet.md); a drop-out is rejected by none.
PIPELINE_EXPECTED_CHECKS: dict[str, frozenset[str]] = {
    kind: frozenset() if attack.drop_out is not None else frozenset({"pipeline"})
    for kind, attack in PIPELINE_ATTACKS.items()
}
