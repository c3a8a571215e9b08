"""The identity of a task environment, as the run pins it: on the wire and in every rollout row.

The run's operator announces it with every policy (`RunParameters.environment`, docs/protocol.md "Swarm"),
and every rollout row carries its one-line form (`environment`, "Rollout files"), so that a node or a
validator whose installed environment differs stops naming the package and version to install, and a row
whose reward was computed with another environment is rejected naming what differs. The environments
themselves live in node/environments/ (environment.py re-exports this class); the wire needs only what
identifies one, so it is defined here, below every role.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import StringConstraints

from .wire import WireModel

ENV_NAME_PATTERN = r"[a-z][a-z0-9_]{0,63}"
CONTENT_HASH_PATTERN = r"sha256:[0-9a-f]{64}"
# A distribution name (PEP 508) and its version (PEP 440 spellings, local versions included): what a peer
# must `pip install`. Neither may hold a space, so a pin splits back into its parts.
PACKAGE_PATTERN = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9])?"
VERSION_PATTERN = r"[A-Za-z0-9][A-Za-z0-9.+!_-]{0,47}"
# The longest pin: name, package and version at their limits, the hash, two spaces and "==".
MAX_PIN_CHARS = 64 + 1 + 64 + 2 + 48 + 1 + 71


class EnvironmentIdentity(WireModel):
    """What peers compare to know they draw the same tasks and score them the same way.

    `version` is the version of the distribution that provides the environment (the package a peer must
    install); `content_hash` covers the environment's configuration (family, mix, seed, size), the bytes of
    any task file, and anything else its tasks or rewards depend on, so two machines agree on it exactly
    when they would draw and score identically.
    """

    name: Annotated[str, StringConstraints(pattern=f"^{ENV_NAME_PATTERN}$")]  # registered environment name
    package: Annotated[str, StringConstraints(pattern=f"^{PACKAGE_PATTERN}$")]  # what provides it
    version: Annotated[str, StringConstraints(pattern=f"^{VERSION_PATTERN}$")]  # that package's version
    content_hash: Annotated[str, StringConstraints(pattern=f"^{CONTENT_HASH_PATTERN}$")]

    def describe(self) -> str:
        """For messages: `reasoning_gym (reasoning-gym 0.1.25, sha256:0123456789ab...)`."""
        return f"{self.name} ({self.package} {self.version}, {self.content_hash[:19]}...)"

    @property
    def requirement(self) -> str:
        """What to install to have it: `PACKAGE==VERSION`."""
        return f"{self.package}=={self.version}"

    @property
    def pin(self) -> str:
        """The one-line form rollout rows carry: `NAME PACKAGE==VERSION sha256:<hex>` (at most MAX_PIN_CHARS)."""
        return f"{self.name} {self.requirement} {self.content_hash}"


def pin_difference(theirs: str, ours: str) -> str:
    """What a row's environment pin `theirs` (a peer's string, bounded by the reader) changes against the
    run's `ours`: another environment, another version of it, or another configuration of it."""
    their_parts, our_parts = theirs.split(" "), ours.split(" ")
    if len(their_parts) != 3 or len(our_parts) != 3:
        return f"environment {theirs[:MAX_PIN_CHARS]!r}, not the run's {ours!r}"
    (their_name, their_requirement, their_hash), (name, requirement, content) = their_parts, our_parts
    if their_name != name:
        return f"another environment ({their_name!r}, the run's is {name!r})"
    if their_requirement != requirement:
        return (
            f"another version of environment {name!r} ({their_requirement!r}, the run's is {requirement!r})"
        )
    if their_hash != content:
        return f"another configuration of environment {name!r} ({their_hash!r}, the run's is {content!r})"
    return "the run's environment"
