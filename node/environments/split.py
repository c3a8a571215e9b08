"""A held-out split by content: whether a problem may be trained on is a function of its prompt text.

Holding problems out by index is not holding them out: the built-in family has only 200 distinct level-1
problems (and about 20,000 at level 2), so a problem with a held-out index almost always shares its prompt
with problems that were trained on. A content split hashes the prompt instead, so a held-out prompt never
occurs in training, whatever index it comes under; accuracy on it measures what generalises.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from ..errors import TaskError
from .environment import Environment
from .types import Task

_DOMAIN = b"prime-node/heldout-split/v1\x00"
_SCALE = 1 << 64


class ContentSplit:
    """The prompts whose SHA-256 (domain-separated) falls in the first `fraction` of the hash space."""

    def __init__(self, fraction: float) -> None:
        if not 0.0 <= fraction < 1.0:
            raise TaskError(f"held-out fraction must be in [0, 1), got {fraction!r}")
        self.fraction = fraction
        self._bound = int(fraction * _SCALE)

    def is_heldout(self, prompt: str) -> bool:
        digest = hashlib.sha256(_DOMAIN + prompt.encode("utf-8")).digest()
        return int.from_bytes(digest[:8], "big") < self._bound

    def trainable(self, environment: Environment, start: int = 0) -> Iterator[Task]:
        """The problems of `environment` from index `start` upwards whose prompts are not held out."""
        for index in range(start, len(environment)):
            task = environment.get(index)
            if not self.is_heldout(task.prompt):
                yield task

    def heldout_from_end(self, environment: Environment, count: int, scan_limit: int) -> list[Task]:
        """Up to `count` held-out problems, scanning down from the last index (at most `scan_limit` indices):
        the end of the set is where evaluation problems have always come from, far from the training indices."""
        found: list[Task] = []
        stop = max(len(environment) - scan_limit, 0)
        for index in range(len(environment) - 1, stop - 1, -1):
            task = environment.get(index)
            if self.is_heldout(task.prompt):
                found.append(task)
                if len(found) == count:
                    break
        return found
