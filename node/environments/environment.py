"""The one environment interface: what a run draws its tasks from and scores its completions with.

An environment has an identity (name, version, and a hash of whatever defines its tasks and scoring), a
deterministic task list (index -> Task), and a scorer (completion, task) -> reward in [0, 1]. Contributors
and validators open the same environment from the run's announced parameters and must compute the same
rewards, so everything here is a pure function of the environment's configuration: never of call order,
time, the machine or the network.

Scoring runs on text written by untrusted peers and is repeated by validators, so a scorer must be total
(it never raises: an unparseable completion scores 0), deterministic, and bounded. An environment says how
its scorer is bounded (`scoring`): `inline` scorers are pure Python whose cost is bounded by the input
bounds they apply themselves (integer or exact match); every other scorer (a symbolic-math library, a
puzzle family's own checker, a program under test) runs where a hang or a crash costs one zero, never the
process (see scoring.py and sandbox.py).

Environments come from Python entry points in the group `prime_node.environments` (registry.py); the
built-in ones are registered by this package's own pyproject the same way.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

# The identity is a wire type (the run pins it: p2p/environment_identity.py); it is re-exported here, with the
# patterns of its fields, as part of the interface.
from ...p2p.environment_identity import (
    CONTENT_HASH_PATTERN,
    ENV_NAME_PATTERN,
    PACKAGE_PATTERN,
    VERSION_PATTERN,
    EnvironmentIdentity,
)
from .types import Task

__all__ = [
    "CONTENT_HASH_PATTERN",
    "ENTRY_POINT_GROUP",
    "ENV_NAME_PATTERN",
    "PACKAGE_PATTERN",
    "VERSION_PATTERN",
    "Environment",
    "EnvironmentIdentity",
    "ScoringLimits",
]

ENTRY_POINT_GROUP = "prime_node.environments"


class ScoringLimits(BaseModel):
    """How one call of a scorer is bounded. `inline`: in the calling process (the scorer bounds itself);
    `process`: in a worker process with these limits, a breach scoring 0; `sandbox`: an untrusted program
    run by the scorer is confined by sandbox.py (the scorer itself runs as `process`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    isolation: Literal["inline", "process", "sandbox"] = Field(
        "process", description="Where the scorer runs (see the class docstring)."
    )
    wall_s: float = Field(5.0, gt=0, le=600, description="Wall-clock limit of one score, seconds.")
    cpu_s: float = Field(5.0, gt=0, le=600, description="CPU-time limit of one score, seconds.")
    memory_mb: int = Field(1024, ge=64, le=65536, description="Address-space limit of the worker, MiB.")


@runtime_checkable
class Environment(Protocol):
    """Tasks and their scorer. `get` and `score` must be pure functions of the configuration and inputs.

    An environment may also define `warm_up() -> None` (optional, not part of the protocol's required surface):
    the scoring worker calls it once when it loads the environment, under the load's generous time limit, so
    that lazy imports and first-use caches (sympy's parsers, say) are not paid inside one completion's
    wall-clock limit. Without it, a worker replacing one a breach killed could score an honest completion 0 on a
    busy machine.
    """

    @property
    def spec(self) -> str:
        """The `--env` value that reopens exactly this environment: `NAME[:ARGS]`."""
        ...

    @property
    def identity(self) -> EnvironmentIdentity: ...

    @property
    def scoring(self) -> ScoringLimits: ...

    def __len__(self) -> int: ...

    def get(self, index: int) -> Task:
        """The task at `index`, 0 <= index < len(self); raises TaskError otherwise."""
        ...

    def score(self, completion: str, task: Task) -> float:
        """The reward of `completion` on `task`, in [0, 1]; never raises (0 for anything unusable)."""
        ...
