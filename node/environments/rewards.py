"""The one path from a completion to a task reward: an environment's scorer, bounded as it says.

Contributors (node/run/validation.py RunTasks), validators (the same RunTasks), difficulty filtering and
`prime-node tasks preview` all score through `EnvironmentScorer`, so a reward is computed the same way
wherever it is computed. An `inline` environment's scorer runs here, in the calling thread: it bounds its
own input (verifier.py), and is as cheap as a function call. Any other isolation runs the scorer where a
hang or a crash costs one zero, never the process (node/environments/scoring.py).

Whatever the scorer returns is held to the interface's promise before anyone uses it: a float in [0, 1].
Anything else (NaN, a bool, 7, an exception from an environment that broke its promise to be total) is 0,
on every machine alike, and logged, so a broken scorer is seen without costing an honest node its file.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import threading
from collections.abc import Callable

from .environment import Environment, ScoringLimits
from .scoring import BoundedScorer
from .types import Task

logger = logging.getLogger(__name__)

BoundedScore = Callable[[str, Task], float]


# One bounded scorer (one worker process) per set of limits, for the life of the process: a contributor
# rebuilds its RunTasks at every checkpoint, and a worker that has loaded an environment keeps it loaded.
_BOUNDED: dict[ScoringLimits, BoundedScorer] = {}
_BOUNDED_LOCK = threading.Lock()


def isolated_scorer(environment: Environment) -> BoundedScore:
    """The scorer of an environment whose ScoringLimits ask for `process` or `sandbox`: run by
    node/environments/scoring.py's BoundedScorer in a worker process with CPU-time, memory and wall-clock
    limits, where a breach, a crash or a hang scores 0 and costs a fresh worker, never this process."""
    with _BOUNDED_LOCK:
        scorer = _BOUNDED.get(environment.scoring)
        if scorer is None:
            scorer = _BOUNDED[environment.scoring] = BoundedScorer(environment.scoring)
    return functools.partial(scorer.score, environment)


@atexit.register
def _close_workers() -> None:
    with _BOUNDED_LOCK:
        for scorer in _BOUNDED.values():
            scorer.close()
        _BOUNDED.clear()


def checked_reward(value: object, environment: Environment) -> float:
    """`value` when it is a finite float (or int) in [0, 1], else 0.0 (logged)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        reward = float(value)
        if math.isfinite(reward) and 0.0 <= reward <= 1.0:
            return reward
    logger.warning(
        "environment %s returned %r, not a reward in [0, 1]: scored 0", environment.identity.name, value
    )
    return 0.0


class EnvironmentScorer:
    """Scores completions on `environment`'s tasks, through its ScoringLimits."""

    def __init__(self, environment: Environment) -> None:
        self.environment = environment
        inline = environment.scoring.isolation == "inline"
        self._score: BoundedScore = environment.score if inline else isolated_scorer(environment)

    def __call__(self, completion: str, task: Task) -> float:
        try:
            value: object = self._score(completion, task)
        except Exception as exc:  # the interface promises a total scorer; one that raises gets 0, not a crash
            logger.warning(
                "environment %s raised %s scoring a completion: scored 0",
                self.environment.identity.name,
                type(exc).__name__,
            )
            return 0.0
        return checked_reward(value, self.environment)
