"""Helpers for the swarm tests: start N real swarm peers on 127.0.0.1 and end every child by PID."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from hivemind.dht.routing import DHTID

from prime_node.p2p.environment_identity import EnvironmentIdentity
from prime_node.p2p.identity import Identity
from prime_node.p2p.processes import end_pids, pid_alive
from prime_node.p2p.swarm import Hardware, RunParameters, Swarm, SwarmConfig

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
# What a policy record announces about the run (any valid values: the swarm tests do not generate rollouts).
RUN_PARAMETERS = RunParameters(
    run_id="swarmtest",
    run_seed=0,
    environment=EnvironmentIdentity(
        name="arithmetic", package="prime-node", version="0.1.0", content_hash="sha256:" + "0" * 64
    ),
    samples=4,
    temperature=1.0,
    max_new_tokens=64,
    compute_dtype="float32",
    length_targets=[],
    length_alpha=0.001,
)
logging.getLogger("hivemind").setLevel(logging.WARNING)


def config(run_id: str, operator: Identity, **overrides: Any) -> SwarmConfig:
    fields: dict[str, Any] = dict(
        run_id=run_id,
        operator_keys=[operator.node_id],
        host_maddrs=LOOPBACK,
        wait_timeout_s=5.0,  # generous: CI cores are shared with the rest of the suite
        startup_timeout_s=60.0,  # p2pd took over 30 s to start on 2 cores at load average 30
        heartbeat_interval_s=2.0,
        heartbeat_ttl_s=20.0,
        policy_poll_s=0.2,
        handoff_timeout_s=10.0,
    )
    fields.update(overrides)
    return SwarmConfig(**fields)


class SwarmFleet:
    """Peers started by a test; `close` leaves them all and then ends any surviving child by PID."""

    def __init__(self, run_id: str, operator: Identity) -> None:
        self.run_id, self.operator = run_id, operator
        self.peers: list[Swarm] = []
        self._pids: set[int] = set()

    async def add(
        self,
        identity: Identity | None = None,
        *,
        roles: tuple[str, ...] = ("contributor",),
        bootstrap: list[str] | None = None,
        hardware: Hardware | None = None,
        **overrides: Any,
    ) -> Swarm:
        peers = bootstrap if bootstrap is not None else await self.bootstrap()
        swarm = Swarm(
            config(self.run_id, self.operator, initial_peers=peers, **overrides),
            identity or Identity.generate(),
            roles=roles,
            hardware=hardware,
        )
        self.peers.append(swarm)
        try:
            await swarm.join()
        finally:
            if swarm.process is not None:
                self._pids.update(swarm.process.pids)
        return swarm

    async def bootstrap(self) -> list[str]:
        live = [p for p in self.peers if p.process is not None and not p.client_mode]
        return (await live[0].maddrs())[:1] if live else []

    async def close(self) -> None:
        for swarm in self.peers:
            if swarm.process is not None:
                self._pids.update(swarm.process.pids)
        await asyncio.gather(*(s.leave() for s in self.peers), return_exceptions=True)
        end_pids(sorted(self._pids), 3.0)
        assert not [pid for pid in self._pids if pid_alive(pid)], "a swarm child process survived"


@contextlib.asynccontextmanager
async def fleet(run_id: str, operator: Identity) -> AsyncIterator[SwarmFleet]:
    group = SwarmFleet(run_id, operator)
    try:
        yield group
    finally:
        await group.close()


async def cancel_and_wait(tasks: list[asyncio.Task[Any]], timeout: float = 30.0) -> None:
    """Cancel `tasks` and wait for them, cancelling again every half second (a cancellation can be lost on
    3.11, e.g. inside wait_for as the awaited call completes); fails naming, with its stack, any task still
    running after `timeout`."""
    deadline = time.monotonic() + timeout
    pending = {t for t in tasks if not t.done()}
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    if pending:
        stuck = []
        for task in pending:
            frames = task.get_stack()
            where = f"{frames[-1].f_code.co_filename}:{frames[-1].f_lineno}" if frames else "?"
            stuck.append(f"{task.get_name()} at {where}")
        raise AssertionError(f"tasks ignored cancellation for {timeout:.0f} s: {'; '.join(stuck)}")


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.2) -> float:
    """Poll `check` until it is true; returns the seconds it took, fails the test after `timeout`."""
    start = time.monotonic()
    while True:
        if await check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


async def _local_subkeys(_dht: Any, node: Any, key: str) -> list[Any]:
    # Runs inside a DHT child process (hivemind's run_coroutine): what this peer itself holds.
    key_id = DHTID.generate(source=key)
    found: list[Any] = []
    for storage in (node.protocol.storage, node.protocol.cache):
        item = storage.get(key_id)
        if item is not None and hasattr(item.value, "items"):
            found.extend(subkey for subkey, _ in item.value.items())
        elif item is not None:
            found.append(None)  # a regular value under the key
    return found


async def local_subkeys(swarm: Swarm, key: str) -> list[Any]:
    """Subkeys stored (or cached) under `key` in this peer's own DHT process."""
    from functools import partial

    assert swarm.process is not None
    future = swarm.process.dht.run_coroutine(partial(_local_subkeys, key=key), return_future=True)
    return await asyncio.wait_for(future, 30)
