"""Errors of the pipeline wire format (one base, under the p2p package's)."""

from __future__ import annotations

from ..errors import P2PError


class PipelineWireError(P2PError):
    """A pipeline frame or layout is malformed, oversized, out of order or badly signed."""


class CommitmentMismatch(PipelineWireError):
    """A frame's tensor bytes hash as its signed header says, but its signed activation commitment is not the
    one those bytes give: provable fraud by the sender (the frame is the evidence)."""
