"""`prime-node trainer` as a real subprocess on 127.0.0.1: crash safety and what it publishes.

The rollout files are produced by the real engine from the tiny model and accepted by the real verifier
(tests/support/trainer_service.py), then dropped into the trainer's inbox as the validator does.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_node.node.run.announcement import run_parameters
from prime_node.node.run.settings import RunSettings
from prime_node.p2p.identity import Identity
from prime_node.p2p.processes import end_pids
from prime_node.p2p.swarm import Swarm
from prime_node.p2p.weights.fetch import Fetcher
from prime_node.p2p.weights.store import Store
from prime_node.proofs.rollout_file import read_rollout_file
from prime_node.trainer.service.consumed import ConsumedLedger

from support.attack import make_checkpoint
from support.swarm import config as swarm_config
from support.trainer_service import (
    RUN_ID,
    deliver,
    make_accepted_files,
    read_ready,
    start_trainer,
    trainer_argv,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    end_pids([p.pid for p in started], 10.0)
    for proc in started:
        if proc.stdout is not None:
            proc.stdout.close()


def _log_lines(data: Path) -> list[dict]:
    path = data / "trainer" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _wait(predicate, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")


def test_sigkill_mid_run_resumes_without_reusing_a_rollout(tmp_path: Path, processes) -> None:
    model = make_checkpoint(tmp_path / "model")
    key, data, log = tmp_path / "op.key", tmp_path / "data", tmp_path / "trainer.log"
    Identity.generate().save(key)
    staged = make_accepted_files(model, 0, 6, tmp_path / "stage")
    groups = {
        f"{read_rollout_file(p).sha256}:{r.sample_index}" for p in staged for r in read_rollout_file(p).rows
    }
    for path in staged:
        deliver(path, data / "accepted")
    argv = trainer_argv(model, key, data, "--no-dht", "--async-level", "8")

    first = start_trainer(argv, log)
    processes.append(first)
    read_ready(first, log)
    # Steps run back to back (under a second each), so right after the first one is logged the trainer is
    # inside the next: training, saving or publishing it.
    _wait(lambda: len(_log_lines(data)) >= 1, 120, "the first step", log)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(10)
    before = _log_lines(data)
    steps_before = [r["step"] for r in before]

    second = start_trainer(argv, log)
    processes.append(second)
    ready = read_ready(second, log)
    # It resumes from the newest complete state: at least every logged step, at most one more (saved, not logged).
    assert steps_before[-1] <= ready["step"] <= steps_before[-1] + 1

    def all_groups_settled() -> bool:
        # A batch needs 6 samples (two groups of 3): at most one group may be left waiting for another.
        with ConsumedLedger(data / "trainer" / "consumed.sqlite") as ledger:
            counts = ledger.counts()
        return counts["reserved"] == 0 and counts["consumed"] + counts["dropped"] >= len(groups) - 1

    _wait(all_groups_settled, 120, "every accepted group to be used or dropped", log)
    time.sleep(1.0)  # nothing more may happen: the last group waits for a partner that never comes
    os.killpg(second.pid, signal.SIGTERM)
    assert second.wait(40) == 0, log.read_text()[-3000:]

    lines = _log_lines(data)
    steps = [r["step"] for r in lines]
    assert steps == sorted(set(steps)), f"a step number repeats or goes back: {steps}"
    assert [s for s in steps if s > ready["step"]] == list(range(ready["step"] + 1, steps[-1] + 1))
    used = [g for r in lines for g in r["groups_used"]]
    assert len(used) == len(set(used)), "a rollout group was trained on twice"
    with ConsumedLedger(data / "trainer" / "consumed.sqlite") as ledger:
        consumed = {
            f"{f}:{k}"
            for f, k in ledger._db.execute(
                "SELECT file_id, group_key FROM groups WHERE state = 'consumed'"
            ).fetchall()
        }
    assert set(used) <= consumed <= groups
    # Only the step that was durable but unlogged at the kill may have consumed groups the log does not show.
    unlogged = consumed - set(used)
    assert len(unlogged) <= 2 * 3, unlogged
    store = Store(data / "weights")
    assert store.high_water() == steps[-1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


async def _policy(swarm: Swarm, step: int, log: Path, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        policy = await swarm.current_policy()
        if policy is not None and policy.step >= step:
            return policy
        await asyncio.sleep(0.3)
    raise AssertionError(f"no policy for step {step} in the DHT; trainer log:\n{log.read_text()[-4000:]}")


async def test_trainer_publishes_checkpoints_and_policies_a_fetcher_verifies(
    tmp_path: Path, processes
) -> None:
    model = make_checkpoint(tmp_path / "model")
    key, data, log = tmp_path / "op.key", tmp_path / "data", tmp_path / "trainer.log"
    operator = Identity.generate()
    operator.save(key)
    argv = trainer_argv(model, key, data, "--listen", "/ip4/127.0.0.1/tcp/0", "--swarm-run-id", "svc-pub")
    proc = start_trainer(argv, log)
    processes.append(proc)
    ready = await asyncio.to_thread(read_ready, proc, log)
    assert ready["step"] == 0 and ready["maddrs"]
    reader = Swarm(swarm_config("svc-pub", operator, initial_peers=ready["maddrs"][:1]), Identity.generate())
    reader_pids: list[int] = []
    try:
        await reader.join(heartbeat=False)
        reader_pids = list(reader.process.pids) if reader.process else []
        genesis = await _policy(reader, 0, log)
        assert genesis.step == 0 and genesis.sources == [ready["weights"]]
        # It announces its [run] section: here the defaults and trainer_argv's --run-id.
        assert genesis.run == run_parameters(RunSettings(run_id=RUN_ID))
        fetched = await Fetcher(genesis.sources, operator.node_id, Store(tmp_path / "node")).fetch(0)
        assert fetched.manifest.digest == genesis.manifest_sha256
        names = {p.name for p in fetched.checkpoint_dir.iterdir()}
        assert "model.safetensors" in names and "optimizer.pt" not in names
        assert (fetched.checkpoint_dir / "model.safetensors").read_bytes() == (
            model / "model.safetensors"
        ).read_bytes()

        # One accepted file whose two groups both carry signal makes one batch (6 samples): the trainer trains,
        # publishes and announces step 1.
        staged = await asyncio.to_thread(
            make_accepted_files, model, 0, 1, tmp_path / "stage", informative=True
        )
        deliver(staged[0], data / "accepted")
        policy = await _policy(reader, 1, log)
        assert policy.step == 1
        step1 = await Fetcher(policy.sources, operator.node_id, Store(tmp_path / "node")).fetch(1)
        assert step1.manifest.digest == policy.manifest_sha256
        assert (step1.checkpoint_dir / "model.safetensors").read_bytes() != (
            model / "model.safetensors"
        ).read_bytes()
        # Prometheus gauges follow the steps.
        deadline = time.monotonic() + 20
        while "prime_node_trainer_policy_step 1.0" not in (
            text := await asyncio.to_thread(_get, ready["metrics"])
        ):
            assert time.monotonic() < deadline, text
            await asyncio.sleep(0.2)
        assert "prime_node_trainer_grad_norm" in text and "prime_node_trainer_task_reward" in text
        # A fetcher pinned to another key refuses the trainer's checkpoint.
        with pytest.raises(Exception, match="(?i)sign|key"):
            await Fetcher(policy.sources, Identity.generate().node_id, Store(tmp_path / "other")).fetch(1)
    finally:
        await reader.leave()
        end_pids(reader_pids, 3.0)
    os.killpg(proc.pid, signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 40) == 0, log.read_text()[-3000:]
    metrics = _log_lines(data)
    assert [r["step"] for r in metrics] == [1]
    for name in (
        "task_reward",
        "length_penalty",
        "entropy",
        "clip_fraction",
        "grad_norm",
        "kl",
        "tokens_per_s",
    ):
        assert name in metrics[0]
