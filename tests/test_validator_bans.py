"""Ban records in the DHT follow the ledger: republished for a ban's whole length, forever when permanent,
no longer once lifted; checked from another peer of a real swarm with second-scale durations."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from prime_node.p2p.identity import Identity
from prime_node.trainer.ledger import AsyncLedger, BanEntry, Ledger
from prime_node.trainer.validator.bans import BanPublisher

from support.swarm import fleet, wait_until

RUN = "validator-bans"
RECORD_TTL = 2.0  # one DHT record lives 2 s ...
REPUBLISH = 0.5  # ... and is stored again every 0.5 s while its ban is in force
TIMED = 6.0


def _ban(node: str, until: float | None, ban_id: int = 1) -> BanEntry:
    return BanEntry(ban_id, node, "test", 1000.0, until, None, None, None)


def test_record_lifetime_follows_the_ban() -> None:
    publisher = BanPublisher(
        None,
        None,
        Identity.generate(),
        record_ttl_s=100.0,
        republish_s=10.0,  # type: ignore[arg-type]
    )
    node = "ab" * 32
    assert publisher.record_ttl(_ban(node, None), 1000.0) == 100.0  # permanent: one full record at a time
    assert publisher.record_ttl(_ban(node, 1030.0), 1000.0) == 30.0  # the last record ends with the ban
    assert publisher.record_ttl(_ban(node, 1000.01), 1000.0) is None  # over
    assert publisher.due(_ban(node, None), 1000.0)  # never stored by this process
    with pytest.raises(ValueError, match="before their records expire"):
        BanPublisher(
            None,
            None,
            Identity.generate(),
            record_ttl_s=10.0,
            republish_s=10.0,  # type: ignore[arg-type]
        )


@pytest.mark.slow
async def test_ban_records_live_exactly_as_long_as_the_bans(tmp_path: Path) -> None:
    operator = Identity.generate()
    timed, permanent, lifted = (Identity.generate().node_id for _ in range(3))
    ledger = AsyncLedger(Ledger(tmp_path / "ledger.sqlite"))
    try:
        async with fleet(RUN, operator) as group:
            publisher_swarm = await group.add(operator, roles=("validator",), ban_ttl_s=RECORD_TTL)
            observer = await group.add()
            now = time.time()
            timed_ends = now + TIMED
            await ledger.ban(timed, "timed ban", until=timed_ends)
            await ledger.ban(permanent, "permanent ban", until=None)
            await ledger.ban(lifted, "a mistake", until=None)
            publisher = BanPublisher(
                ledger, publisher_swarm, operator, record_ttl_s=RECORD_TTL, republish_s=REPUBLISH
            )
            seen: list[tuple[float, frozenset[str]]] = []

            async def observe() -> None:
                while True:
                    seen.append((time.time(), frozenset(await observer.read_bans())))
                    await asyncio.sleep(0.1)

            tasks = [
                asyncio.create_task(publisher.run(), name="ban-publisher"),
                asyncio.create_task(observe(), name="ban-observer"),
            ]
            try:
                await wait_until(lambda: _sees(observer, {timed, permanent, lifted}), 15, interval=0.1)
                lifted_at = time.time()
                assert await asyncio.to_thread(ledger.ledger.lift_bans, lifted) == 1
                await wait_until(lambda: _gone(observer, timed), TIMED + RECORD_TTL + 10, interval=0.1)
                await asyncio.sleep(1.0)  # a few more observations after the timed ban ended
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            slack = 1.5  # DHT round trips on shared CI cores; the durations are several record lifetimes
            first = next(t for t, bans in seen if timed in bans)
            # The timed ban stays visible for its whole length, far beyond one record's lifetime ...
            assert all(timed in bans for t, bans in seen if first <= t <= timed_ends - slack)
            assert timed_ends - first > 2 * RECORD_TTL
            # ... and is gone once it ended: its last record expired with it, nothing republished it.
            assert all(timed not in bans for t, bans in seen if t >= timed_ends + slack)
            # The permanent ban was refreshed the whole time.
            assert all(permanent in bans for t, bans in seen if t >= first + slack)
            # The lifted ban was not republished: it vanished within one record lifetime of the lift.
            assert all(lifted not in bans for t, bans in seen if t >= lifted_at + RECORD_TTL + slack)
            assert seen[-1][0] >= lifted_at + RECORD_TTL + slack
            row = await ledger.query("SELECT record FROM bans WHERE node_id = ?", (permanent,))
            assert row[0]["record"] is not None  # the operator-signed BanRecord is kept in the ledger
    finally:
        await ledger.close()


async def _sees(observer, nodes: set[str]) -> bool:  # noqa: ANN001
    return nodes <= set(await observer.read_bans())


async def _gone(observer, node: str) -> bool:  # noqa: ANN001
    return node not in await observer.read_bans()
