"""An environment whose scorer misbehaves on command, for the bounded scorer's tests (tests/test_scoring.py).

The completion says what the scorer does: `hang` loops forever (a wall-clock or a CPU-time
breach, whichever limit is lower), `alloc` allocates without bound, `exit` ends the interpreter (os._exit),
`segfault` crashes it in C, `raise` raises, `nan` returns NaN, `sleep:S` sleeps S seconds, and anything else
is honest: 1.0 when it equals the task's answer, else 0.0. It is importable by the worker process because
the worker inherits the parent's sys.path.
"""

from __future__ import annotations

import ctypes
import os
import time

from prime_node.node.environments.environment import EnvironmentIdentity, ScoringLimits
from prime_node.node.environments.types import Task


class HostileScorerEnvironment:
    def __init__(self, limits: ScoringLimits) -> None:
        self._limits = limits

    @property
    def spec(self) -> str:
        return "hostile"

    @property
    def identity(self) -> EnvironmentIdentity:
        return EnvironmentIdentity(
            name="hostile", package="prime-node", version="0", content_hash="sha256:" + "0" * 64
        )

    @property
    def scoring(self) -> ScoringLimits:
        return self._limits

    def __len__(self) -> int:
        return 10

    def get(self, index: int) -> Task:
        return Task(prompt=f"say {index}", answer=str(index), task_type="exact")

    def score(self, completion: str, task: Task) -> float:
        if completion == "hang":
            while True:
                pass
        if completion == "alloc":
            hoard = []
            while True:
                hoard.append(bytearray(16 * 1024 * 1024))
        if completion == "exit":
            os._exit(3)
        if completion == "segfault":
            ctypes.string_at(0)
        if completion == "raise":
            raise ValueError("a scorer that is not total")
        if completion == "nan":
            return float("nan")
        if completion.startswith("sleep:"):
            time.sleep(float(completion.removeprefix("sleep:")))
            return 0.5
        return 1.0 if completion == task.answer else 0.0
