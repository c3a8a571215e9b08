"""An environment whose scorer misbehaves on command, for the bounded scorer's tests (tests/test_scoring.py).

The completion says what the scorer does: `hang` loops forever (a wall-clock or a CPU-time
breach, whichever limit is lower), `alloc` allocates without bound, `exit` ends the interpreter (os._exit),
`segfault` crashes it in C, `raise` raises, `nan` returns NaN, `sleep:S` sleeps S seconds, `warmed` scores 1.0
only when `warm_up` ran in this process (the worker calls it at load, outside a score's wall clock; it takes
`warm_up_s`, which the warm-up test sets above the wall-clock limit, as lazy imports can take on a busy
machine), and anything else
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
    def __init__(self, limits: ScoringLimits, *, warm_up_s: float = 0.0) -> None:
        self._limits = limits
        self._warm_up_s = warm_up_s  # how long warm_up takes (the warm-up test: longer than one score may)

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

    def warm_up(self) -> None:
        time.sleep(self._warm_up_s)
        self.warmed = True

    def get(self, index: int) -> Task:
        return Task(prompt=f"say {index}", answer=str(index), task_type="exact")

    def score(self, completion: str, task: Task) -> float:
        if completion == "hang":
            while True:
                pass
        if completion == "alloc":
            hoard = []
            while True:
                # bytes(n) is calloc'ed: the address space runs out (RLIMIT_AS, a MemoryError) at once, without
                # first writing a gibibyte of zeros, which a busy machine can make slower than the wall-clock limit.
                hoard.append(bytes(16 * 1024 * 1024))
        if completion == "exit":
            os._exit(3)
        if completion == "segfault":
            ctypes.string_at(0)
        if completion == "raise":
            raise ValueError("a scorer that is not total")
        if completion == "nan":
            return float("nan")
        if completion == "warmed":
            return 1.0 if getattr(self, "warmed", False) else 0.0
        if completion.startswith("sleep:"):
            time.sleep(float(completion.removeprefix("sleep:")))
            return 0.5
        return 1.0 if completion == task.answer else 0.0
