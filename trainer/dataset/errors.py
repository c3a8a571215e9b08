"""The dataset package's one exception base."""

from __future__ import annotations

from ..errors import TrainerError


class DatasetError(TrainerError):
    """A dataset cannot be built or read: the message names the input and what to change."""
