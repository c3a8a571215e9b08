"""`prime-node validator` as a real process: SIGKILLed with files spooled, each gets exactly one verdict."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from prime_node.node.models.tiny import build_tiny_model
from prime_node.p2p.identity import Identity
from prime_node.trainer.devnet.processes import Child, ProcessGroup
from prime_node.trainer.ledger import Ledger

from support.attack import engine_from, make_checkpoint, run_tasks
from support.swarm import fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    SPEC,
    VALIDATOR_RUN,
    announce_run,
    publish_checkpoint,
    rows_for,
    sees_a_validator,
    write_file,
)

TRAINER = Identity.from_seed(b"\x5b" * 32)  # a second operator key: it announces the run's policies

CONFIG = f"""
[run]
run_id = "{RUN}"
run_seed = {SPEC.run_seed}
samples = {SPEC.samples}
temperature = {SPEC.temperature}
max_new_tokens = {SPEC.max_new_tokens}

[engine]
threads = 1

[swarm]
run_id = "{RUN}"
operator_keys = ["{OPERATOR.node_id}", "{TRAINER.node_id}"]
host_maddrs = ["/ip4/127.0.0.1/tcp/0"]
reachability = "public"
heartbeat_interval_s = 2.0
heartbeat_ttl_s = 20.0
policy_poll_s = 0.5

[dashboard]
port = 0
"""


def _start(group: ProcessGroup, name: str, key: Path, data: Path, config: Path) -> tuple[Child, dict]:
    argv = [
        sys.executable,
        "-m",
        "prime_node.node.cli.main",
        "validator",
        "--key",
        str(key),
        "--data-dir",
        str(data),
        "--config",
        str(config),
    ]
    child = group.start(name, argv)
    ready: dict = {}

    def is_ready() -> bool:
        for line in child.log_path.read_text(errors="replace").splitlines():
            if line.startswith('{"validator"'):
                ready.update(json.loads(line))
                return True
        assert child.process.poll() is None, child.log_tail()
        return False

    assert group.wait_until(is_ready, 90), child.log_tail()
    return child, ready


def _verdicts(data: Path) -> dict[str, tuple[int, float]]:
    with Ledger(data / "ledger.sqlite") as ledger:
        rows = ledger.query("SELECT file_hash, node_id, accepted, decided_at FROM contributions")
    assert len({(r["file_hash"], r["node_id"]) for r in rows}) == len(
        {r["file_hash"] for r in rows}
    )  # one sender
    return {r["file_hash"]: (r["accepted"], r["decided_at"]) for r in rows}


@pytest.mark.slow
async def test_sigkilled_validator_gives_each_spooled_file_one_verdict_after_restart(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "model")
    engine, tasks = engine_from(build_tiny_model(0)[0]), run_tasks(checkpoint)
    node = Identity.generate()
    files = [
        write_file(
            tmp_path / f"r{step}-{counter}.parquet",
            rows_for(engine, tasks, node, policy_step=step, batch_counter=counter),
            node,
        )
        for step, counter in ((0, 0), (1, 0), (1, 1))
    ]
    key, data, config = tmp_path / "operator.key", tmp_path / "validator", tmp_path / "validator.toml"
    OPERATOR.save(key)
    config.write_text(CONFIG)
    publish_checkpoint(checkpoint, data / "validator-weights", 0)  # step 1 is not held: its files wait
    with ProcessGroup(tmp_path / "logs") as group:
        first, ready = _start(group, "validator-1", key, data, config)
        async with fleet(RUN, OPERATOR) as peers:
            trainer = await peers.add(
                TRAINER,
                roles=("trainer",),
                bootstrap=ready["maddrs"][:1],
                operator_keys=[OPERATOR.node_id, TRAINER.node_id],
            )
            await announce_run(trainer, VALIDATOR_RUN)  # the validator verifies nothing before it
            sender = await peers.add(node, bootstrap=ready["maddrs"][:1], reachability="public")
            await wait_until(lambda: sees_a_validator(sender), 20)
            for path, envelope in files:
                await sender.send_rollout(path, envelope)  # each receipt means: spooled and fsynced
        await wait_until(lambda: _async(files[0][1].sha256 in _verdicts(data)), 30)
        # The verdict is recorded before the accepted file is delivered and leaves the spool: wait for both,
        # so the kill finds exactly the two undecided files spooled.
        await wait_until(lambda: _async(len(list((data / "spool").glob("*.parquet"))) == 2), 30)
        before = _verdicts(data)
        assert set(before) == {files[0][1].sha256}  # the two step-1 files are spooled, undecided
        os.killpg(first.pid, signal.SIGKILL)  # the validator, its DHT child and p2pd, no cleanup
        first.process.wait(timeout=10)
        assert len(list((data / "spool").glob("*.parquet"))) == 2

        publish_checkpoint(checkpoint, data / "validator-weights", 1)  # the checkpoint arrives meanwhile
        # The restarted validator has no DHT peer (the trainer is gone): it resumes from the run parameters
        # the first one recorded as confirmed.
        second, _ = _start(group, "validator-2", key, data, config)
        hashes = {envelope.sha256 for _, envelope in files}
        await wait_until(lambda: _async(set(_verdicts(data)) == hashes), 60)
        after = _verdicts(data)
        assert all(accepted == 1 for accepted, _ in after.values()), second.log_tail()
        assert after[files[0][1].sha256] == before[files[0][1].sha256]  # decided once, never again
        await wait_until(lambda: _async(not list((data / "spool").glob("*.parquet"))), 10)
        assert sorted(p.name for p in (data / "accepted").glob("*.parquet")) == sorted(
            f"{h}-{node.node_id}.parquet" for h in hashes
        )
        code, killed = group.stop(second, grace=30)  # SIGTERM: graceful
        assert code == 0 and not killed, second.log_tail()


async def _async(value: bool) -> bool:
    return value
