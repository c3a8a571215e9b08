"""The run pins its environment: announced with every policy (a node or validator whose installed or configured
environment differs stops, naming the package and version to install), and carried by every rollout row with
the prompt format (a row whose reward was computed with another environment version or configuration, or
whose prompts were built otherwise, is rejected with a reason naming it)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from prime_node.node.environments import ArithmeticConfig, ArithmeticEnvironment, EnvironmentIdentity
from prime_node.node.run.announcement import RunMismatchError, check_announced_run, run_parameters
from prime_node.node.run.settings import RunSettings
from prime_node.node.run.validation import RunTasks
from prime_node.p2p.identity import Identity
from prime_node.trainer.devnet.processes import ProcessGroup

from support.attack import (
    checkpoint_engine,
    honest_rows,
    rejected_by,
    verify,
    write_honest,
    write_signed,
)
from support.node_daemon import NODE_ENV, node_argv, operator_fleet
from support.swarm import fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    publish_checkpoint,
    rows_for,
    running_validator,
    sees_a_validator,
    validator_settings,
    wait_verdict,
    write_file,
)


class _Released(ArithmeticEnvironment):
    """The arithmetic family as another release of prime-node would report it: same tasks, other version."""

    def __init__(self, version: str, config: ArithmeticConfig | None = None) -> None:
        super().__init__(config)
        self._identity = self._identity.model_copy(update={"version": version})


class _Templated(RunTasks):
    """A node that builds its prompts with a chat template (its prompt format is that template's hash)."""

    @property
    def prompt_format(self) -> str:
        return "sha256:" + "c" * 64


def _tasks(environment: ArithmeticEnvironment, like: RunTasks, kind: type[RunTasks] = RunTasks) -> RunTasks:
    return kind(environment, like.tokenizer)


def test_the_announced_environment_names_what_to_install_or_change() -> None:
    ours = run_parameters(RunSettings())
    here = ours.environment
    cases = [
        (
            here.model_copy(update={"version": "0.2.0"}),
            f"run.env: environment arithmetic is prime-node {here.version} here, prime-node 0.2.0 in the run: "
            "install prime-node==0.2.0",
        ),
        (
            EnvironmentIdentity(
                name="reasoning_gym",
                package="reasoning-gym",
                version="0.1.25",
                content_hash=here.content_hash,
            ),
            f"run.env: environment {here.describe()} here, reasoning_gym (reasoning-gym 0.1.25, "
            f"{here.content_hash[:19]}...) in the run: install reasoning-gym==0.1.25 and set run.env to the "
            "run's reasoning_gym environment",
        ),
        (
            here.model_copy(update={"content_hash": "sha256:" + "1" * 64}),
            f"run.env: environment arithmetic (prime-node {here.version}) is configured otherwise here "
            f"({here.content_hash}) than in the run (sha256:{'1' * 64})",
        ),
    ]
    for theirs, line in cases:
        announced = ours.model_copy(update={"environment": theirs})
        for role in ("node", "validator"):
            with pytest.raises(RunMismatchError) as caught:
                check_announced_run(ours, announced, 3, role)
            assert line in str(caught.value)
    check_announced_run(ours, run_parameters(RunSettings()), 3, "node")  # the same environment: no complaint


async def test_a_node_with_another_environment_version_stops_naming_the_package_to_install(
    tmp_path: Path,
) -> None:
    operator_id = Identity.generate()
    data_dir = tmp_path / "node"
    Identity.generate().save(data_dir / "node.key")
    async with operator_fleet(tmp_path / "operator-store", operator_id) as (_, operator):
        # The run's operator runs a newer release of the environment than this node has installed.
        ours = operator.run.environment
        operator.run = operator.run.model_copy(
            update={"environment": ours.model_copy(update={"version": "9.9.9"})}
        )
        await operator.announce(0, "ab" * 32)  # no checkpoint needed: the node must stop before fetching
        argv = node_argv(data_dir, operator_id.node_id, (await operator.swarm.maddrs())[:1])
        with ProcessGroup(tmp_path / "logs") as procs:
            node = procs.start("node", argv, env=NODE_ENV)
            code = await asyncio.to_thread(node.process.wait, 120)
            log = node.log_path.read_text()
    assert code == 1, log
    assert "announces policy step 0 with other run parameters" in log
    assert f"environment arithmetic is prime-node {ours.version} here, prime-node 9.9.9 in the run: " in log
    assert "install prime-node==9.9.9" in log and "Traceback" not in log


def test_rows_carry_the_environment_and_prompt_format_and_another_is_rejected_naming_it(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    checkpoint, engine, tasks = world
    verifier = checkpoint_engine(checkpoint)
    honest = honest_rows(engine, tasks)
    assert {(r.environment, r.prompt_format) for r in honest} == {
        (tasks.environment_pin, tasks.prompt_format)
    }
    report = verify(write_honest(tmp_path / "honest.parquet", honest), verifier, tasks)
    assert report.accepted, report  # the honest control

    run_version = tasks.environment.identity.version
    others = {
        "version": (
            _tasks(_Released("9.9.9"), tasks),
            f"another version of environment 'arithmetic' ('prime-node==9.9.9', the run's is "
            f"'prime-node=={run_version}')",
        ),
        "configuration": (
            # The same tasks under these indices would be a coincidence; the pin says what differs at once.
            _tasks(ArithmeticEnvironment(ArithmeticConfig(seed=1)), tasks),
            "another configuration of environment 'arithmetic' ('sha256:",
        ),
        "prompt format": (
            _tasks(tasks.environment, tasks, _Templated),
            f"prompts in format 'sha256:{'c' * 64}'; the run's prompt format is '{tasks.prompt_format}' "
            "(another chat template",
        ),
    }
    for what, (node_tasks, reason) in others.items():
        rows = honest_rows(engine, node_tasks)
        report = verify(write_honest(tmp_path / f"{what}.parquet", rows), verifier, tasks)
        failed = [c for c in report.checks if c.status == "failed"]
        assert rejected_by(report) == "run-parameters", (what, report)
        assert reason in failed[0].detail and failed[0].row == 0, (what, failed[0])
    # Rows of one file share both: a file that mixes environments is malformed (bounds), whatever row 0 says.
    mixed = [honest[0], dataclasses.replace(honest[1], environment=others["version"][0].environment_pin)]
    report = verify(write_signed(tmp_path / "mixed.parquet", mixed), verifier, tasks)
    detail = next(c.detail for c in report.checks if c.status == "failed")
    assert rejected_by(report) == "bounds" and "row 1: environment 'arithmetic prime-node==9.9.9" in detail


async def test_the_validator_rejects_and_slashes_a_file_computed_with_another_environment(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    checkpoint, engine, tasks = world
    node, honest_node = Identity.generate(), Identity.generate()
    other = rows_for(engine, _tasks(_Released("9.9.9"), tasks), node)
    path, envelope = write_file(tmp_path / "other.parquet", other, node)
    honest_path, honest_envelope = write_file(
        tmp_path / "honest.parquet", rows_for(engine, tasks, honest_node), honest_node
    )
    settings = validator_settings(tmp_path / "validator")
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        senders = [
            await group.add(n, bootstrap=running.maddrs[:1], reachability="public")
            for n in (node, honest_node)
        ]
        for sender in senders:
            await wait_until(lambda s=sender: sees_a_validator(s), 15)
        await senders[0].send_rollout(path, envelope)
        await senders[1].send_rollout(honest_path, honest_envelope)
        verdict = (await wait_verdict(running, envelope.sha256, 60)).document
        control = (await wait_verdict(running, honest_envelope.sha256, 60)).document
        banned = await running.service.ledger.active_ban(node.node_id)  # fraud: banned at once
        honest_banned = await running.service.ledger.active_ban(honest_node.node_id)
    assert not verdict.accepted and verdict.failed_check == "run_parameters", verdict
    assert "another version of environment 'arithmetic' ('prime-node==9.9.9'" in verdict.reason
    assert banned is not None and "run_parameters" in banned.reason
    assert control.accepted and honest_banned is None, control.reason
