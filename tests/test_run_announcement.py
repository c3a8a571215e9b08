"""The trainer announces the run's parameters with every policy; a node or validator configured otherwise
stops at the first such policy, naming each setting to change, before it produces or judges any work.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from prime_node.node.config import load_config
from prime_node.node.engine import EngineSettings
from prime_node.node.errors import ConfigError
from prime_node.node.run.announcement import (
    _SETTING_OF,
    RunMismatchError,
    agreed_policies,
    check_announced_run,
    differences,
    run_parameters,
)
from prime_node.node.run.settings import RunSettings, open_run_environment
from prime_node.node.runtime.supervisor import Supervisor
from prime_node.p2p.identity import Identity
from prime_node.p2p.processes import end_pids
from prime_node.p2p.swarm import PolicyAnnouncement, RunParameters
from prime_node.p2p.weights.store import Store
from prime_node.trainer.devnet.layout import DevnetLayout, Sizing
from prime_node.trainer.devnet.processes import ProcessGroup
from prime_node.trainer.errors import TrainerError
from prime_node.trainer.service.config import TrainerCommandSettings
from prime_node.trainer.service.service import check_policy_fits
from prime_node.trainer.validator.checkpoints import CheckpointKeeper
from prime_node.trainer.validator.run import start_validator
from prime_node.trainer.validator.run_confirmation import RunConfirmation

from support.node_daemon import NODE_ENV, node_argv, operator_fleet
from support.swarm import RUN_PARAMETERS, fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    announce_run,
    publish_checkpoint,
    rows_for,
    running_validator,
    sees_a_validator,
    validator_settings,
    wait_verdict,
    write_file,
)


def _policy(step: int, run: RunParameters) -> PolicyAnnouncement:
    return PolicyAnnouncement(
        step=step, manifest_sha256="ab" * 32, sources=[], published_at=time.time(), run=run
    )


def test_every_run_parameter_is_compared_and_named_with_its_setting() -> None:
    ours = run_parameters(RunSettings())
    assert differences(ours, run_parameters(RunSettings())) == []
    other = run_parameters(
        RunSettings(
            run_id="other",
            run_seed=1,
            task_seed=9,
            samples=8,
            temperature=0.7,
            max_new_tokens=128,
            compute_dtype="bfloat16",
            length_targets=[16],
            length_alpha=0.01,
            system_prompt="Answer after '='.",
            run_kind="synthetic",
            annotators=["small"],
            pipeline={"boundaries": [0, 2, 4]},
        )
    )
    system_digest = hashlib.sha256(b"Answer after '='.").hexdigest()
    hashes = [open_run_environment(RunSettings(task_seed=seed)).identity.content_hash for seed in (0, 9)]
    version = ours.environment.version
    assert differences(ours, other) == [
        "run.run_id: 'local' here, 'other' in the run",
        "run.run_seed: 0 here, 1 in the run",
        f"run.env: environment arithmetic (prime-node {version}) is configured otherwise here ({hashes[0]}) than "
        f"in the run ({hashes[1]}): set run.env (and run.task_seed) as the run does, with the run's task file "
        "where it has one",
        "run.samples: 4 here, 8 in the run",
        "run.temperature: 1.0 here, 0.7 in the run",
        "run.max_new_tokens: 64 here, 128 in the run",
        "run.compute_dtype: 'float32' here, 'bfloat16' in the run",
        "run.length_targets: [] here, [16] in the run",
        "run.length_alpha: 0.001 here, 0.01 in the run",
        f"run.system_prompt (compared by its SHA-256): None here, '{system_digest}' in the run",
        "run.run_kind: 'rl' here, 'synthetic' in the run",
        "run.annotators: [] here, ['small'] in the run",
        "run.pipeline: None here, StageLayout(boundaries=[0, 2, 4], activation_dtype='float32', "
        "encoding='raw-le', prompts=4, micro_batch_size=2) in the run",
    ]
    assert set(RunParameters.model_fields) == {
        "run_id",
        "run_seed",
        "environment",
        "samples",
        "temperature",
        "max_new_tokens",
        "compute_dtype",
        "length_targets",
        "length_alpha",
        "system_prompt_sha256",
        "run_kind",
        "annotators",
        "pipeline",
    }
    assert set(_SETTING_OF) == set(RunParameters.model_fields)  # a new field is compared, not skipped


def test_a_pipelined_batch_shape_other_than_the_runs_stops_the_party_naming_each_setting() -> None:
    # The batch's shape is pinned with the layout: a member that cut its group's batches otherwise than the
    # others would break every batch with nobody knowing why; it stops instead, naming each setting.
    ours = run_parameters(
        RunSettings(pipeline={"boundaries": [0, 2, 4], "prompts": 4, "micro_batch_size": 2})
    )
    announced = run_parameters(
        RunSettings(pipeline={"boundaries": [0, 2, 4], "prompts": 8, "micro_batch_size": 4})
    )
    assert differences(ours, announced) == [
        "run.pipeline.prompts: 4 here, 8 in the run",
        "run.pipeline.micro_batch_size: 2 here, 4 in the run",
    ]
    with pytest.raises(RunMismatchError, match="run.pipeline.micro_batch_size: 2 here, 4 in the run"):
        check_announced_run(ours, announced, 3, "node")
    assert differences(ours, run_parameters(RunSettings(pipeline={"boundaries": [0, 2, 4]}))) == []


def test_a_task_file_is_known_by_its_bytes_not_its_path(tmp_path: Path) -> None:
    first, second, changed = tmp_path / "a.jsonl", tmp_path / "sub" / "b.jsonl", tmp_path / "c.jsonl"
    second.parent.mkdir()
    line = '{"prompt": "1+1=", "answer": "2"}\n'
    first.write_text(line)
    second.write_text(line)
    changed.write_text(line.replace('"2"', '"3"'))
    same = run_parameters(RunSettings(tasks=str(first))), run_parameters(RunSettings(tasks=str(second)))
    digest = hashlib.sha256(line.encode()).hexdigest()
    assert (
        same[0].environment == same[1].environment and same[0].environment.content_hash == f"sha256:{digest}"
    )
    assert run_parameters(RunSettings(tasks=str(changed))).environment != same[0].environment


async def _feed(policies: list[PolicyAnnouncement]) -> AsyncIterator[PolicyAnnouncement]:
    for policy in policies:
        yield policy


async def test_agreed_policies_stop_at_the_first_other_run() -> None:
    ours = run_parameters(RunSettings())
    other = run_parameters(RunSettings(max_new_tokens=32))
    seen = []
    with pytest.raises(RunMismatchError) as caught:
        async for policy in agreed_policies(
            _feed([_policy(1, ours), _policy(2, other), _policy(3, ours)]), ours, "validator"
        ):
            seen.append(policy.step)
    assert seen == [1]  # step 2 is never acted on
    message = str(caught.value)
    assert "policy step 2 with other run parameters than this validator's" in message
    assert "run.max_new_tokens: 64 here, 32 in the run" in message and "rejects honest work" in message


async def test_the_supervisor_raises_the_operators_error_itself_without_a_traceback(caplog) -> None:  # noqa: ANN001
    supervisor = Supervisor("test")
    ours = run_parameters(RunSettings())

    async def watch() -> None:
        async for _ in agreed_policies(
            _feed([_policy(4, run_parameters(RunSettings(temperature=2.0)))]), ours, "node"
        ):
            pass

    with caplog.at_level(logging.ERROR):
        supervisor.spawn("policy-watch", watch())
        with pytest.raises(RunMismatchError, match=r"run.temperature: 1.0 here, 2.0 in the run"):
            await asyncio.wait_for(supervisor.wait(), 10)
    assert (await supervisor.shutdown(5.0)).clean
    record = next(r for r in caplog.records if "run.temperature" in r.getMessage())
    assert record.exc_info is None  # an operator's setting, not a bug: the message is the whole story


def test_the_trainer_takes_its_temperature_and_run_from_the_run_section(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[run]\nrun_id = "r1"\ntemperature = 0.7\nlength_targets = [8]\n')
    settings = load_config(TrainerCommandSettings, toml_path=toml, cli_overrides={"run.max_new_tokens": 32})
    assert settings.trainer.temperature == 0.7  # the log-probabilities use the sampling temperature
    assert (settings.run.run_id, settings.run.max_new_tokens, settings.run.length_targets) == ("r1", 32, [8])
    # The trainer's own copies of run parameters are gone; written the old way they say where they went.
    for old, new, env_name in [
        ("[trainer]\ntemperature = 0.7\n", "run.temperature", "PRIME_NODE_RUN__TEMPERATURE"),
        ("[trainer]\nlength_targets = [8]\n", "run.length_targets", "PRIME_NODE_RUN__LENGTH_TARGETS"),
        ('[service]\nrun_id = "r1"\n', "run.run_id", "PRIME_NODE_RUN__RUN_ID"),
        ('[service]\ntasks = "builtin:arithmetic"\n', "run.tasks", "PRIME_NODE_RUN__TASKS"),
    ]:
        toml.write_text(old)
        with pytest.raises(ConfigError, match=rf"is now '{new}'.*{env_name}"):
            load_config(TrainerCommandSettings, toml_path=toml)
    with pytest.raises(
        ConfigError,
        match=r"'trainer.temperature' \(from environment variable "
        r"PRIME_NODE_TRAINER__TEMPERATURE\) is now 'run.temperature'",
    ):
        load_config(TrainerCommandSettings, env={"PRIME_NODE_TRAINER__TEMPERATURE": "0.7"})


@pytest.mark.slow
async def test_a_node_with_another_temperature_stops_before_any_work(tmp_path: Path) -> None:
    operator_id = Identity.generate()
    data_dir = tmp_path / "node"
    Identity.generate().save(data_dir / "node.key")
    async with operator_fleet(tmp_path / "operator-store", operator_id) as (_, operator):
        await operator.announce(0, "ab" * 32)  # no checkpoint needed: the node must stop before fetching
        argv = node_argv(
            data_dir, operator_id.node_id, (await operator.swarm.maddrs())[:1], "--temperature", "0.7"
        )
        with ProcessGroup(tmp_path / "logs") as procs:
            node = procs.start("node", argv, env=NODE_ENV)
            code = await asyncio.to_thread(node.process.wait, 120)
            log = node.log_path.read_text()
    assert code == 1, log
    assert (
        "prime-node start: error: the run's operator announces policy step 0 with other run parameters" in log
    )
    assert "run.temperature: 0.7 here, 1.0 in the run" in log and "Traceback" not in log
    # The check comes before the checkpoint keeper hears of the policy: no fetch of it was even tried (one
    # would fail on the made-up digest and log "checkpoint step 0 refused").
    assert "checkpoint step 0" not in log


async def test_a_validator_pinned_to_other_parameters_stops_instead_of_slashing(tmp_path: Path) -> None:
    settings = validator_settings(tmp_path / "validator")
    supervisor = Supervisor("test-validator")
    running = await start_validator(settings, OPERATOR, supervisor)
    pids = list(running.swarm.process.pids) if running.swarm.process else []
    try:
        announced = run_parameters(settings.run.model_copy(update={"samples": settings.run.samples + 1}))
        await wait_until(lambda: running.swarm.publish_policy(1, "ab" * 32, [], announced), 15)
        with pytest.raises(RunMismatchError, match=r"run.samples: 2 here, 3 in the run"):
            await asyncio.wait_for(supervisor.wait(), 30)
        assert running.service.keeper.latest_policy is None  # it fetched nothing for that policy
    finally:
        report = await supervisor.shutdown(15.0)
        end_pids(pids, 3.0)
    assert report.clean, report


async def test_a_validator_verifies_nothing_before_a_policy_confirms_its_parameters(
    tmp_path: Path,
    world,  # noqa: ANN001, F811
) -> None:
    checkpoint, engine, tasks = world
    node = Identity.generate()
    path, envelope = write_file(tmp_path / "r.parquet", rows_for(engine, tasks, node), node)
    settings = validator_settings(tmp_path / "validator")
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings, announce=False) as running, fleet(RUN, OPERATOR) as group:
        sender = await group.add(node, bootstrap=running.maddrs[:1], reachability="public")
        await wait_until(lambda: sees_a_validator(sender), 15)
        await sender.send_rollout(path, envelope)  # the receipt: spooled and queued
        await asyncio.sleep(2.0)
        # Still queued, not just undecided: an open worker takes a job off the queue at once, however long
        # verifying it then takes on a busy machine.
        assert len(running.service.queue) == 1
        assert await running.service.ledger.verdict_for(envelope.sha256, node.node_id) is None
        await announce_run(running.swarm, settings.run)
        verdict = (await wait_verdict(running, envelope.sha256, 30)).document
        assert verdict.accepted, verdict.reason
    # Recorded: the same settings resume at once after a restart, other settings wait for the operator.
    ours = run_parameters(settings.run)
    assert RunConfirmation(settings.resolved_data_dir(), ours).confirmed.is_set()
    other = run_parameters(settings.run.model_copy(update={"max_new_tokens": 8}))
    assert not RunConfirmation(settings.resolved_data_dir(), other).confirmed.is_set()
    # A damaged record (here: the right JSON, padded past the size bound) is ignored: wait for the operator.
    record = settings.resolved_data_dir() / "run-parameters.json"
    record.write_text(ours.model_dump_json() + " " * 70_000)
    assert not RunConfirmation(settings.resolved_data_dir(), ours).confirmed.is_set()


async def test_a_step_re_announced_with_other_run_parameters_is_seen_again() -> None:
    operator = Identity.generate()
    changed = RUN_PARAMETERS.model_copy(update={"temperature": 0.5})
    async with fleet("reannounce", operator) as group:
        trainer = await group.add(operator, roles=("trainer",), policy_poll_s=0.2)
        reader = await group.add(policy_poll_s=0.2)
        watcher = reader.watch_policy()
        try:
            await trainer.publish_policy(3, "ab" * 32, [], RUN_PARAMETERS)
            assert (await asyncio.wait_for(anext(watcher), 20)).run == RUN_PARAMETERS
            await trainer.publish_policy(
                3, "ab" * 32, [], RUN_PARAMETERS
            )  # a plain re-announcement: nothing new
            await trainer.publish_policy(3, "ab" * 32, [], changed)  # a restarted trainer with another [run]
            again = await asyncio.wait_for(anext(watcher), 20)
            assert (again.step, again.run) == (3, changed)
        finally:
            await watcher.aclose()


def test_the_devnet_gives_every_party_the_same_run_parameters(tmp_path: Path) -> None:
    from prime_node.node.cli.flags import load_settings
    from prime_node.node.cli.main import build_parser
    from prime_node.node.contributor.settings import StartSettings
    from prime_node.trainer.validator.config import ValidatorSettings

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    layout = DevnetLayout(
        tmp_path / "run",
        "devnet",
        tmp_path / "model",
        sizing=Sizing(samples=2, max_new_tokens=16, length_targets=(3, 9, 17)),
        env_spec=f"file:{tasks}",
    )
    honest, cheater = layout.add_member("node-1"), layout.add_member("adv-1", attack="inflated-rewards")
    peers = ["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWF4NCf4BuFF35ra6sCoMwfpNBVSQppG7VzU6yC98XsiB7"]
    parser = build_parser()

    def announced(argv: list[str], model: type) -> RunParameters:
        return run_parameters(load_settings(parser.parse_args(argv), model).run)

    trainer = announced(layout.trainer_argv(2)[3:], TrainerCommandSettings)
    assert (trainer.run_id, trainer.samples, trainer.max_new_tokens) == ("devnet", 2, 16)
    assert trainer.length_targets == [3, 9, 17]
    assert trainer.environment.name == "file"
    # Without an environment of its own the devnet's commands are what they always were: no --env, no --tasks.
    default = DevnetLayout(tmp_path / "default", "devnet", tmp_path / "model", sizing=Sizing(samples=2))
    assert default.run_flags() == ["--run-id", "devnet", "--samples", "2"]
    assert announced(layout.validator_argv(peers)[3:], ValidatorSettings) == trainer
    assert announced(layout.member_argv(honest, peers)[3:], StartSettings) == trainer
    # The adversary harness parses its `--attack NAME` and hands the rest to `start`.
    assert announced(["start", *layout.member_argv(cheater, peers)[5:]], StartSettings) == trainer


async def test_a_validator_stops_at_start_up_when_the_current_policy_runs_otherwise(tmp_path: Path) -> None:
    trainer_id = Identity.generate()
    operators = [OPERATOR.node_id, trainer_id.node_id]
    settings = validator_settings(tmp_path / "validator")
    async with fleet(RUN, OPERATOR) as group:
        trainer = await group.add(trainer_id, roles=("trainer",), operator_keys=operators)
        await announce_run(trainer, settings.run.model_copy(update={"temperature": 0.9}))
        swarm = settings.swarm.model_copy(
            update={"initial_peers": await trainer.maddrs(), "operator_keys": operators}
        )
        settings = settings.model_copy(update={"swarm": swarm})
        supervisor = Supervisor("test-validator")
        with pytest.raises(RunMismatchError, match=r"run.temperature: 1.0 here, 0.9 in the run"):
            await start_validator(settings, OPERATOR, supervisor)
        report = await supervisor.shutdown(15.0)
        # It stopped before announcing itself as a validator: no node could have sent it a file.
        assert not await trainer.list_validators()
    assert report.clean, report


def test_the_validator_checks_the_environment_it_compared_with_the_run(
    tmp_path: Path,
    world,  # noqa: ANN001, F811
) -> None:
    checkpoint, _, _ = world
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    run = RunSettings(tasks=str(task_file))
    opened = open_run_environment(run)
    identity = run_parameters(run, opened).environment
    store = Store(tmp_path / "weights")
    publish_checkpoint(checkpoint, store.root, 0)
    keeper = CheckpointKeeper(
        store, OPERATOR.node_id, run, EngineSettings(threads=1), keep=2, environment=opened
    )
    task_file.write_text('{"prompt": "1+1=", "answer": "3"}\n')  # edited in place after the comparison
    found = keeper.model_for(0)
    assert found is not None
    assert found[1].environment is opened and found[1].environment.get(0).answer == "2"
    assert run_parameters(run).environment != identity  # what a fresh open would have drawn from instead


def test_policy_sources_too_large_for_the_dht_are_refused_before_any_announcement() -> None:
    sources = [f"http://198.51.100.{i}:8470/" + "x" * 480 for i in range(32)]
    with pytest.raises(
        TrainerError,
        match=r"policy record is \d+ bytes; the limit is 8192: announce fewer or "
        r"shorter service.public_sources \(32 now\)",
    ):
        check_policy_fits(sources, RUN_PARAMETERS)
    check_policy_fits(sources[:4], RUN_PARAMETERS)  # fits, whatever the step grows to
    with pytest.raises(ConfigError, match=r"service.public_sources.0.*ftp://mirror"):
        load_config(TrainerCommandSettings, env={"PRIME_NODE_SERVICE__PUBLIC_SOURCES": '["ftp://mirror/"]'})
