"""The run's parameters as the operator announces them with every policy, and the check every party makes.

A contributor or validator configured with other run parameters than the trainer's would waste the run: the
contributor's files are rejected as not this run's work (`run-parameters`, `prompts` or `assignment`, all
fraud), and a validator pinned to other values rejects every honest file and slashes its sender. Each
policy record therefore carries the trainer's `RunParameters` (docs/protocol.md, "Swarm"); a node or
validator whose own differ stops with the settings to change, before it produces or judges any work for
that policy. Kept out of node/run/settings.py so that `prime-node rollout` and `verify` do not import hivemind.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

from ...p2p.environment_identity import EnvironmentIdentity
from ...p2p.pipeline.layout import layout_differences
from ...p2p.swarm.records import PolicyAnnouncement, RunParameters
from ..environments import Environment
from ..errors import NodeError, OperatorActionNeeded
from .settings import RunSettings, open_run_environment

# Announced field -> the setting that gives it (the environment's identity: what run.env opens here).
_SETTING_OF = {
    "run_id": "run.run_id",
    "run_seed": "run.run_seed",
    "environment": "run.env",
    "samples": "run.samples",
    "temperature": "run.temperature",
    "max_new_tokens": "run.max_new_tokens",
    "compute_dtype": "run.compute_dtype",
    "length_targets": "run.length_targets",
    "length_alpha": "run.length_alpha",
    "system_prompt_sha256": "run.system_prompt (compared by its SHA-256)",
    "run_kind": "run.run_kind",
    "annotators": "run.annotators",
    "pipeline": "run.pipeline",
}


class RunMismatchError(NodeError, OperatorActionNeeded):
    """This party's run parameters differ from those the run's operator announces: it stops, naming them."""


def run_parameters(run: RunSettings, environment: Environment | None = None) -> RunParameters:
    """The wire form of `run` with `environment` (the run's, opened with open_run_environment; None opens it:
    a file is read and hashed, so call it off the event loop)."""
    environment = environment if environment is not None else open_run_environment(run)
    return RunParameters(
        run_id=run.run_id,
        run_seed=run.run_seed,
        environment=environment.identity,
        samples=run.samples,
        temperature=float(run.temperature),
        max_new_tokens=run.max_new_tokens,
        compute_dtype=run.compute_dtype,
        length_targets=list(run.length_targets),
        length_alpha=float(run.length_alpha),
        system_prompt_sha256=system_prompt_sha256(run.system_prompt),
        run_kind=run.run_kind,
        annotators=list(run.annotators),
        pipeline=run.pipeline,
    )


def system_prompt_sha256(system_prompt: str) -> str | None:
    """The announced form of the run's system prompt: the SHA-256 of its UTF-8 text, None when empty."""
    return hashlib.sha256(system_prompt.encode("utf-8")).hexdigest() if system_prompt else None


def environment_difference(ours: EnvironmentIdentity, theirs: EnvironmentIdentity) -> str:
    """What to do when the run's environment `theirs` is not the installed and configured `ours`."""
    if ours.name != theirs.name:
        return (
            f"run.env: environment {ours.describe()} here, {theirs.describe()} in the run: install "
            f"{theirs.requirement} and set run.env to the run's {theirs.name} environment"
        )
    if (ours.package, ours.version) != (theirs.package, theirs.version):
        return (
            f"run.env: environment {ours.name} is {ours.package} {ours.version} here, {theirs.package} "
            f"{theirs.version} in the run: install {theirs.requirement}"
        )
    return (
        f"run.env: environment {ours.name} ({ours.package} {ours.version}) is configured otherwise here "
        f"({ours.content_hash}) than in the run ({theirs.content_hash}): set run.env (and run.task_seed) "
        "as the run does, with the run's task file where it has one"
    )


def differences(ours: RunParameters, announced: RunParameters) -> list[str]:
    """One line per differing parameter: the setting, our value and the run's (empty when they agree)."""
    lines = []
    for name, setting in _SETTING_OF.items():
        mine, theirs = getattr(ours, name), getattr(announced, name)
        if mine == theirs:
            continue
        if name == "environment":
            lines.append(environment_difference(mine, theirs))
        elif name == "pipeline" and mine is not None and theirs is not None:  # the field, not two layouts
            lines.extend(
                f"{setting}.{field}: {a!r} here, {b!r} in the run"
                for field, a, b in layout_differences(mine, theirs)
            )
        else:
            lines.append(f"{setting}: {mine!r} here, {theirs!r} in the run")
    return lines


def check_announced_run(ours: RunParameters, announced: RunParameters, step: int, role: str) -> None:
    """RunMismatchError naming every differing setting when `announced` (policy `step`) is not `ours`."""
    found = differences(ours, announced)
    if found:
        raise RunMismatchError(
            f"the run's operator announces policy step {step} with other run parameters than this {role}'s:\n  "
            + "\n  ".join(found)
            + f"\nSet them as the run does (under [run] in the config file, PRIME_NODE_RUN__<NAME> in the "
            f"environment, or the flags) and start again: a {role} with other run parameters "
            + ("produces files every validator rejects." if role == "node" else "rejects honest work.")
        )


async def agreed_policies(
    policies: AsyncIterator[PolicyAnnouncement], ours: RunParameters, role: str
) -> AsyncIterator[PolicyAnnouncement]:
    """The policies of `policies` (Swarm.watch_policy()); RunMismatchError at the first one announced with
    other run parameters than `ours`, before anything acts on it."""
    async for policy in policies:
        check_announced_run(ours, policy.run, policy.step, role)
        yield policy
