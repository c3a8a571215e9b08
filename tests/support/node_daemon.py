"""Helpers for the contributor-daemon tests: a test operator (publishes, serves and announces checkpoints),
a `prime-node start` subprocess, and reading what a validator received."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from prime_node.node.run.announcement import run_parameters
from prime_node.node.run.settings import RunSettings
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import RunParameters, Swarm
from prime_node.p2p.weights.publish import publish
from prime_node.p2p.weights.server import ServeSettings, WeightsServer
from prime_node.p2p.weights.store import Store

from support.swarm import fleet

RUN_ID = "nodetest"
# The run parameters node_argv gives the node, as the test operator announces them.
NODE_RUN = RunSettings(run_id=RUN_ID, samples=2, max_new_tokens=16)


class TestOperator:
    """Publishes checkpoints into its store, serves them over HTTP and announces them in the DHT."""

    __test__ = False  # not a test class, despite its name

    def __init__(
        self, identity: Identity, swarm: Swarm, store_dir: Path, run: RunParameters | None = None
    ) -> None:
        self.identity, self.swarm = identity, swarm
        self.run = run or run_parameters(NODE_RUN)  # announced with every policy
        self.store = Store(store_dir)
        self.server = WeightsServer(self.store, ServeSettings(port=0, scan_interval_s=0.2), identity.node_id)
        self.url = ""

    async def start(self) -> None:
        self.url = await self.server.start()

    async def publish(self, ckpt: Path, step: int) -> str:
        manifest, _ = await asyncio.to_thread(
            publish,
            ckpt,
            step=step,
            identity=self.identity,
            out_dir=self.store.root,
            run_id=RUN_ID,
            shard_size=1 << 20,
        )
        await self.server.rescan()
        return manifest.digest

    async def announce(self, step: int, digest: str) -> None:
        # Like a real trainer, republish until a DHT peer holds it (a peer that was just SIGKILLed can make
        # one round fail while the routing tables still list it).
        for _ in range(5):
            if await self.swarm.publish_policy(step, digest, [self.url], self.run):
                return
            await asyncio.sleep(1.0)
        raise AssertionError(f"no DHT peer stored the policy of step {step}")

    def served_file(self, step: int, name: str) -> Path:
        return self.store.checkpoint_dir(step) / name


@contextlib.asynccontextmanager
async def operator_fleet(
    store_dir: Path, operator_id: Identity, run: RunSettings = NODE_RUN
) -> AsyncIterator[tuple[Any, TestOperator]]:
    """A DHT whose first peer is a started test operator announcing `run` (the fleet, the operator)."""
    async with fleet(RUN_ID, operator_id) as group:
        swarm = await group.add(operator_id, roles=("trainer",))
        operator = TestOperator(operator_id, swarm, store_dir, run_parameters(run))
        await operator.start()
        try:
            yield group, operator
        finally:
            await operator.server.stop()


def node_argv(data_dir: Path, operator_key: str, peers: list[str], *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "prime_node.node.cli.main",
        "start",
        "--data-dir",
        str(data_dir),
        "--operator-key",
        operator_key,
        "--peers",
        *peers,
        "--run-id",
        RUN_ID,
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
        "--reachability",
        "public",
        "--prompts",
        "2",
        "--samples",
        "2",
        "--max-new-tokens",
        "16",
        "--threads",
        "1",
        "--status-port",
        "0",  # a free port: the default one is fixed (docs/metrics.md) and tests run side by side
        *extra,
    ]


NODE_ENV = {
    "PRIME_NODE_SWARM__POLICY_POLL_S": "0.3",
    "PRIME_NODE_SWARM__HEARTBEAT_INTERVAL_S": "1.0",
    "PRIME_NODE_SWARM__HEARTBEAT_TTL_S": "20",
    "PRIME_NODE_SWARM__HANDOFF_TIMEOUT_S": "10",
    "PRIME_NODE_HANDOFF_RETRY_S": "0.5",
    "PRIME_NODE_FETCH_RETRY_S": "1.0",
    "PRIME_NODE_MAX_RETRY_S": "2.0",
    "PRIME_NODE_SHUTDOWN_TIMEOUT_S": "15",
    "PRIME_NODE_FETCH__MAX_ATTEMPTS_PER_SHARD": "2",
}


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prime_node.node.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PRIME_NODE_ENGINE__THREADS": "1"},
    )


def node_status(data_dir: Path) -> dict[str, Any] | None:
    result = cli("status", "--json", "--data-dir", str(data_dir), timeout=30)
    return json.loads(result.stdout) if result.returncode == 0 else None


def policy_steps(path: Path) -> set[int]:
    return set(pq.read_table(path, columns=["policy_step"]).column("policy_step").to_pylist())


def pending_shas(data_dir: Path) -> set[str]:
    return {p.name.removesuffix(".parquet") for p in (data_dir / "rollouts" / "pending").glob("*.parquet")}


async def poll(check: Any, timeout: float, what: str, child: Any = None, interval: float = 0.3) -> Any:
    """Poll a sync `check` (run in a thread) until it returns something truthy; fail naming `what`.

    With `child` (a ProcessGroup child), fail at once with its log if it exits meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and child.process.poll() is not None:
            raise AssertionError(
                f"the node exited ({child.process.returncode}) while waiting for {what}:\n"
                + child.log_tail(60)
            )
        value = await asyncio.to_thread(check)
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
