"""Helpers of the validator service tests: a tiny checkpoint, rollout files, and a validator in-process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from hivemind.utils import get_dht_time

from prime_node.node.engine import EngineSettings, HFEngine
from prime_node.node.models.tiny import build_tiny_model
from prime_node.node.run.announcement import run_parameters
from prime_node.node.run.producer import BatchSpec, produce_rows
from prime_node.node.run.settings import RunSettings
from prime_node.node.run.validation import RunTasks
from prime_node.node.runtime.supervisor import Supervisor
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import RolloutEnvelope, Swarm
from prime_node.p2p.swarm.process import end_pids
from prime_node.p2p.swarm.records import RecordKind, dht_key, seal
from prime_node.p2p.verdicts import Signed, Verdict
from prime_node.p2p.weights.publish import publish
from prime_node.proofs.rollout_file import signature_path, write_rollout_file
from prime_node.proofs.rollout_schema import RolloutRow
from prime_node.trainer.validator.config import IntakeSettings, ValidatorServiceSettings, ValidatorSettings
from prime_node.trainer.validator.dashboard import DashboardSettings
from prime_node.trainer.validator.run import RunningValidator, start_validator

from support.attack import engine_from, make_checkpoint, run_tasks
from support.swarm import config

RUN = "validator-test"
OPERATOR = Identity.from_seed(b"\x5a" * 32)
SPEC = BatchSpec(
    run_id=RUN,
    run_seed=3,
    policy_step=0,
    batch_counter=0,
    prompts=1,
    samples=2,
    temperature=1.0,
    max_new_tokens=24,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFEngine, RunTasks]:
    """A tiny checkpoint on disk, an engine of the same weights for producing files, and the run's tasks."""
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")
    return checkpoint, engine_from(build_tiny_model(0)[0]), run_tasks(checkpoint)


# The run SPEC's files belong to, as the validators of these tests are configured and the operator announces it.
VALIDATOR_RUN = RunSettings(
    run_id=RUN,
    run_seed=SPEC.run_seed,
    samples=SPEC.samples,
    temperature=SPEC.temperature,
    max_new_tokens=SPEC.max_new_tokens,
)


def validator_settings(
    data_dir: Path, swarm: dict[str, Any] | None = None, **intake: Any
) -> ValidatorSettings:
    return ValidatorSettings(
        data_dir=data_dir,
        run=VALIDATOR_RUN,
        engine=EngineSettings(threads=1),
        swarm=config(RUN, OPERATOR, reachability="public", **(swarm or {})),
        dashboard=DashboardSettings(port=0),
        intake=IntakeSettings(**intake),
        validator=ValidatorServiceSettings(announce_interval_s=30.0),
    )


def rows_for(engine: HFEngine, tasks: RunTasks, node: Identity, **spec: Any) -> list[RolloutRow]:
    return produce_rows(engine, tasks, node.node_id, dataclasses.replace(SPEC, **spec)).rows


def write_file(path: Path, rows: list[RolloutRow], node: Identity) -> tuple[Path, RolloutEnvelope]:
    write_rollout_file(path, rows, node)
    return path, RolloutEnvelope.model_validate_json(signature_path(path).read_bytes())


def envelope_for(node: Identity, data: bytes, batch: tuple[int, int] | None = None) -> RolloutEnvelope:
    """`data`'s v2 envelope as the node's writer signs it: the batch its rows hold (read from the Parquet bytes)
    unless `batch` is given (for files whose columns should not be read, such as bombs)."""
    if batch is None:
        table = pq.read_table(io.BytesIO(data), columns=["policy_step", "batch_counter"])
        batch = (table.column(0)[0].as_py(), table.column(1)[0].as_py())
    return RolloutEnvelope.sign(node, data, batch)


def publish_checkpoint(checkpoint: Path, store_dir: Path, step: int) -> None:
    publish(checkpoint, step=step, identity=OPERATOR, out_dir=store_dir, shard_size=1 << 20, run_id=RUN)


@contextlib.asynccontextmanager
async def running_validator(
    settings: ValidatorSettings, announce: bool = True, identity: Identity = OPERATOR
) -> AsyncIterator[RunningValidator]:
    """A validator in this process; with `announce`, the operator (the validator's own key) announces a policy
    with the validator's run parameters, which it waits for before verifying (trainer/validator/run_confirmation.py).
    `identity` must be one of `settings`' operator keys."""
    supervisor = Supervisor("test-validator")
    pids: list[int] = []
    try:
        running = await start_validator(settings, identity, supervisor)
        assert running.swarm.process is not None
        pids = list(running.swarm.process.pids)
        if announce:
            await announce_run(running.swarm, settings.run)
        yield running
    finally:
        report = await supervisor.shutdown(15.0)
        end_pids(pids, 3.0)
        assert report.clean, report


async def announce_run(swarm: Swarm, run: RunSettings, step: int = 0) -> None:
    """Announce policy `step` with `run`'s parameters (no weight sources: the tests place checkpoints)."""
    assert await swarm.publish_policy(step, "00" * 32, [], run_parameters(run))


async def wait_verdict(
    running: RunningValidator, sha256: str, timeout: float, node_id: str | None = None
) -> Signed[Verdict]:
    """The verdict on `node_id`'s delivery of the file; without `node_id`, on the one sender that delivered it."""
    deadline = time.monotonic() + timeout
    ledger = running.service.ledger.ledger
    while time.monotonic() < deadline:
        if node_id is not None:
            found = await asyncio.to_thread(ledger.verdict_for, sha256, node_id)
        else:
            verdicts = await asyncio.to_thread(ledger.verdicts_for, sha256)
            assert len(verdicts) <= 1, f"several senders delivered {sha256[:16]}: name the node"
            found = verdicts[0] if verdicts else None
        if found is not None:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"no verdict for {sha256[:16]} within {timeout} s")


async def bind_node_ids(peer: Swarm, identities: list[Identity], ttl_s: float = 120.0) -> None:
    """Give each identity a valid signed heartbeat naming `peer`'s libp2p peer id (one host, many node ids),
    so `peer` may hand off files signed by any of them."""
    assert peer.process is not None
    template = (await peer.list_peers())[peer.node_id]
    expiration = get_dht_time() + ttl_s
    for identity in identities:
        body = template.model_copy(update={"node_id": identity.node_id})
        value = seal(identity, peer.config.run_id, RecordKind.HEARTBEAT, identity.node_id, body, expiration)
        await peer.process.dht.store(
            dht_key(peer.config.run_id, RecordKind.HEARTBEAT),
            value,
            expiration,
            subkey=identity.node_id,
            return_future=True,
        )


async def sees_a_validator(swarm) -> bool:  # noqa: ANN001
    """Whether `swarm` (a peer) reads any validator announcement: wait on it before handing off a file."""
    return bool(await swarm.list_validators())
