"""Errors of pipelined generation (under the node package's base)."""

from __future__ import annotations

from ..errors import NodeError


class PipelineError(NodeError):
    """A stage cannot run its part: a frame that does not fit the batch's schedule, or a group that broke."""
