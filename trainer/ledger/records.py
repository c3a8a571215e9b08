"""The ledger's row types and the checks on what goes into it (node ids, a heartbeat's hardware).

Plain values and pure functions, no queries: trainer/ledger/ledger.py writes and reads them,
trainer/ledger/async_ledger.py hands them to async code, the validator signs and publishes `BanEntry.to_record()`.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from ...p2p.verdicts import BanRecord, Signed, Verdict
from ...p2p.wire import is_hex64
from ...proofs.work_identity import SampleId
from .db import LedgerError
from .slashing import Action

MAX_HARDWARE_BYTES = 4096


@dataclass(frozen=True)
class BanEntry:
    """One row of the bans table."""

    id: int
    node_id: str
    reason: str
    created_at: float
    until: float | None  # None: permanent
    lifted_at: float | None
    file_hash: str | None
    record: str | None  # the operator-signed BanRecord envelope, once published

    def active(self, now: float) -> bool:
        return self.lifted_at is None and (self.until is None or self.until > now)

    def to_record(self, issuer_id: str) -> BanRecord:
        """The document the operator signs to publish this ban."""
        return BanRecord.outgoing(
            node_id=self.node_id,
            reason=self.reason,  # made printable and cut (readers refuse control characters); the ledger keeps it
            issued_at=self.created_at,
            until=self.until,
            issuer_id=issuer_id,
        )


@dataclass(frozen=True)
class RewardPoint:
    """One point of the reward curve: the accepted rollouts of one policy step."""

    step: int
    reward: float  # mean task reward per sample, in [0, 1]
    samples: int
    files: int


class DuplicateWork(LedgerError):
    """An accepted verdict was not recorded: one of its samples was accepted before, in `holder` (file hash),
    or occurs twice in the file itself (`holder` None). Nothing was written; record a rejection instead."""

    def __init__(self, sample: SampleId, holder: str | None) -> None:
        where = f"file {holder[:16]}…" if holder is not None else "this same file (a repeated row)"
        super().__init__(f"sample ({sample.describe()}) was already accepted in {where}")
        self.sample = sample
        self.holder = holder


@dataclass(frozen=True)
class RecordResult:
    verdict: Signed[Verdict]  # the stored verdict: on a resend, the first one
    duplicate: bool  # this (file hash, sender) already had a verdict: a resend, recorded once
    actions: tuple[Action, ...]  # what this call applied (empty on a resend)
    new_bans: tuple[BanEntry, ...]  # bans this call created: sign and publish them


def load_verdict(envelope: str) -> Signed[Verdict]:
    # Our own file, written from a verified document: parsed strictly, not re-verified against a trust set.
    data = json.loads(envelope)
    return Signed[Verdict](
        document=Verdict.model_validate(data["document"]), signature=bytes.fromhex(data["signature"])
    )


def ban_entry(row: sqlite3.Row) -> BanEntry:
    return BanEntry(**{name: row[name] for name in BanEntry.__dataclass_fields__})


def check_node_id(node_id: str) -> None:
    if not is_hex64(node_id):
        raise LedgerError(f"node id must be 64 lowercase hex digits, got {str(node_id)[:80]!r}")


def hardware_to_json(hardware: dict[str, Any]) -> str:
    """Hardware comes from a peer's heartbeat: a small flat object of short strings and numbers only."""
    if not isinstance(hardware, dict):
        raise LedgerError("hardware must be a JSON object")
    for key, value in hardware.items():
        if not isinstance(key, str) or len(key) > 64:
            raise LedgerError(f"hardware key {str(key)[:80]!r} must be a string of at most 64 characters")
        if not (
            value is None
            or isinstance(value, (bool, int, float))
            or (isinstance(value, str) and len(value) <= 256)
        ):
            raise LedgerError(f"hardware value for {key!r} must be a number, a boolean or a short string")
    try:
        text = json.dumps(hardware, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError as exc:
        raise LedgerError(f"hardware is not finite JSON: {exc}") from None
    if len(text.encode()) > MAX_HARDWARE_BYTES:
        raise LedgerError(f"hardware description is over {MAX_HARDWARE_BYTES} bytes")
    return text
