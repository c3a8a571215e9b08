"""Errors of pipelined generation (under the node package's base)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import NodeError

if TYPE_CHECKING:
    from ...proofs.pipeline.records import HopFraud, SignedStageRecord


class PipelineError(NodeError):
    """A stage cannot run its part: a frame that does not fit the batch's schedule, or a group that broke."""


class FraudDetected(PipelineError):
    """A stage received a frame whose signed commitment its tensor belies; `fraud` is the evidence
    (proofs/pipeline/blame.py check_fraud blames the sender with it)."""

    def __init__(self, message: str, fraud: HopFraud) -> None:
        super().__init__(message)
        self.fraud = fraud


class BatchBroken(PipelineError):
    """A stage refused a frame the schedule does not call for, so the batch broke; `partial` is every member's
    partial record at that moment (what each hands the validator: proofs/pipeline/broken.py blame_broken)."""

    def __init__(self, message: str, partial: list[SignedStageRecord]) -> None:
        super().__init__(message)
        self.partial = partial
