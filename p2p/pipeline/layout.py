"""The stage layout of a pipelined run: which decoder layers each stage holds and how activations travel.

It is a run parameter (RunParameters.pipeline, announced with every policy, and carried by every
operator-signed group record): every member of a group, and the validator that judges it, must cut the model
at the same boundaries and encode activations alike, or the boundary commitments of honest stages would not
compare; and they must agree on the shape of a group's batch (`prompts`, `micro_batch_size`), which decides
the samples a batch generates and the frames each stage expects: two honest members that each chose their own
would break every batch, with nothing to say why.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import Field, model_validator

from ..signing import canonical_json
from ..wire import WireModel

MAX_STAGES = 64
MAX_LAYERS = 1024

ActivationDtype = Literal["float32", "bfloat16"]
MAX_BATCH_PROMPTS = 4096  # as a node's own `prompts` (rows: times the run's samples)


class StageLayout(WireModel):
    """Layer boundaries and the activation encoding of a pipelined run."""

    # Stage s holds decoder layers [boundaries[s], boundaries[s + 1]); at least two stages; the first entry is 0,
    # the last the model's layer count, strictly increasing (no empty stage). [0, 2, 4]: two stages of 4 layers.
    boundaries: list[int] = Field(min_length=3, max_length=MAX_STAGES + 1)
    # Dtype activations are computed and sent in; float32 keeps pipelined generation bit-identical to one node.
    activation_dtype: ActivationDtype = "float32"
    # Raw little-endian tensor bytes, row-major: the one encoding (no pickle, no torch serialisation).
    encoding: Literal["raw-le"] = "raw-le"
    # Problems in one batch of a group (each with the run's `samples` completions): `work_for`'s assignment.
    # Absent in an older record: 4, the default of a node's own `prompts` then used.
    prompts: int = Field(4, ge=1, le=MAX_BATCH_PROMPTS)
    # Samples per micro-batch: stage 0's cut of the batch, hence every frame's rows and shape. Absent in an
    # older record: 2, the default of the node setting `pipeline.micro_batch_size` then used.
    micro_batch_size: int = Field(2, ge=1, le=MAX_BATCH_PROMPTS)

    @model_validator(mode="after")
    def _increasing(self) -> StageLayout:
        bounds = self.boundaries
        if bounds[0] != 0:
            raise ValueError(f"boundaries must start at 0, got {bounds[0]}")
        if bounds[-1] > MAX_LAYERS:
            raise ValueError(f"boundaries end at {bounds[-1]} layers; at most {MAX_LAYERS}")
        for left, right in zip(bounds, bounds[1:]):
            if right <= left:
                raise ValueError(f"boundaries must strictly increase (no empty stage): {bounds}")
        return self

    @property
    def stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def layers(self) -> int:
        return self.boundaries[-1]

    def layer_range(self, stage: int) -> range:
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} outside [0, {self.stages})")
        return range(self.boundaries[stage], self.boundaries[stage + 1])


def layout_differences(ours: StageLayout, theirs: StageLayout) -> list[tuple[str, object, object]]:
    """(field, ours, theirs) for every field in which two layouts differ (empty when they are equal): for a
    message that names the setting to change and both values rather than printing two whole layouts."""
    return [
        (name, getattr(ours, name), getattr(theirs, name))
        for name in StageLayout.model_fields
        if getattr(ours, name) != getattr(theirs, name)
    ]


def layout_digest(layout: StageLayout) -> str:
    """SHA-256 hex of the layout's canonical JSON (every field, defaults included): what a group id binds, so a
    group formed under another layout (other boundaries, encoding or batch shape) is another group."""
    return hashlib.sha256(canonical_json(layout.model_dump(mode="json"))).hexdigest()
