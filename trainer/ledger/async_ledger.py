"""The ledger for async code: each call runs in a worker thread so the event loop never waits on disk."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...p2p.verdicts import BanRecord, Signed, Verdict
from ...proofs.work_identity import SampleId
from .records import BanEntry, RecordResult

if (
    TYPE_CHECKING
):  # trainer/ledger/ledger.py re-exports this class, so it cannot be imported from there at run time
    from .ledger import Ledger


class AsyncLedger:
    """The ledger for async code: each call runs in a worker thread so the event loop never waits on disk."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    async def record(
        self,
        signed: Signed[Verdict],
        *,
        received_at: float | None = None,
        task_reward_sum: float | None = None,
        samples: Sequence[SampleId] = (),
        credit_share: float = 1.0,
    ) -> RecordResult:
        return await asyncio.to_thread(
            self.ledger.record,
            signed,
            received_at=received_at,
            task_reward_sum=task_reward_sum,
            credit_share=credit_share,
            samples=samples,
        )

    async def verdict_for(self, file_hash: str, node_id: str) -> Signed[Verdict] | None:
        return await asyncio.to_thread(self.ledger.verdict_for, file_hash, node_id)

    async def touch_node(
        self, node_id: str, *, seen_at: float | None = None, hardware: dict[str, Any] | None = None
    ) -> None:
        await asyncio.to_thread(self.ledger.touch_node, node_id, seen_at=seen_at, hardware=hardware)

    async def active_ban(self, node_id: str, now: float | None = None) -> BanEntry | None:
        return await asyncio.to_thread(self.ledger.active_ban, node_id, now)

    async def active_bans(self, now: float | None = None) -> list[BanEntry]:
        return await asyncio.to_thread(self.ledger.active_bans, now)

    async def ban(
        self, node_id: str, reason: str, *, until: float | None, at: float | None = None
    ) -> BanEntry:
        return await asyncio.to_thread(self.ledger.ban, node_id, reason, until=until, at=at)

    async def attach_ban_record(self, ban_id: int, signed: Signed[BanRecord]) -> None:
        await asyncio.to_thread(self.ledger.attach_ban_record, ban_id, signed)

    async def query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        return await asyncio.to_thread(self.ledger.query, sql, params)

    async def close(self) -> None:
        await asyncio.to_thread(self.ledger.close)
