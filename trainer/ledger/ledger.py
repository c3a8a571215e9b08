"""The contribution ledger: every verdict, the credit and slashes it caused, bans, and node metadata.

SQLite in WAL mode with a busy timeout (trainer/ledger/db.py). Every write is one `BEGIN IMMEDIATE`
transaction: a verdict, its contribution row and the slashing actions it caused commit together.

A verdict belongs to (file hash, sender): two nodes may deliver the same bytes (one re-signing the other's
file) and each is judged on its own. The ledger is idempotent on that pair: recording a verdict for a file
this sender already has one for changes nothing and returns the verdict stored first, so a resent file is
credited once and its sender gets the same signed verdict again.

Work is identified by what it is, not by its bytes (proofs/work_identity.py): an accepted verdict records
the identity of each of its samples under a unique key, in the transaction that records the verdict, so no
sample is ever accepted twice whatever file carries it (`DuplicateWork`).

All methods block (disk I/O, fsync). In async code use `AsyncLedger`, which runs them with
`asyncio.to_thread`; the connection is shared between threads under a lock.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...p2p.verdicts import MAX_BAN_REASON_CHARS, BanRecord, Signed, Verdict
from ...proofs.work_identity import SampleId, first_repeat
from .db import Database, LedgerError, LedgerSettings
from .records import (
    BanEntry,
    DuplicateWork,
    RecordResult,
    RewardPoint,
    ban_entry,
    check_node_id,
    hardware_to_json,
    load_verdict,
)
from .slashing import (
    UNATTRIBUTED_CHECKS,
    Action,
    Ban,
    Credit,
    NodeHistory,
    PastRejection,
    Slash,
    SlashingPolicy,
    decide,
)

logger = logging.getLogger(__name__)


class Ledger:
    """The validator's ledger over one SQLite file; see docs/ledger.md for the schema and the policy."""

    def __init__(
        self, path: Path, policy: SlashingPolicy | None = None, *, settings: LedgerSettings | None = None
    ) -> None:
        self.path = Path(path)
        self.policy = policy or SlashingPolicy()
        self.db = Database(self.path, settings or LedgerSettings(path=self.path))

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- verdicts ---------------------------------------------------------------------------------------

    def record(
        self,
        signed: Signed[Verdict],
        *,
        received_at: float | None = None,
        task_reward_sum: float | None = None,
        samples: Sequence[SampleId] = (),
        credit_share: float = 1.0,
    ) -> RecordResult:
        """Store a verdict and apply the slashing policy to it, once per (file hash, sender).

        `task_reward_sum`: the sum of an accepted file's task rewards as the validator recomputed them (the
        reward curve, `reward_curve`); left out for rejected files.
        `samples`: the identities of an accepted file's rows, one per row (the validator always gives them).
        If any was accepted before, in any file, or occurs twice among them, nothing is written and
        `DuplicateWork` names it: the caller records a rejection instead.
        `credit_share`: the share of one unit of work an accepted file earns (`accept_credit` x share), in
        (0, 1]: a pipelined stage file's share of the model's layers; ignored for a rejected file.
        """
        v = signed.document
        received = v.decided_at if received_at is None else received_at
        if task_reward_sum is not None and not (v.accepted and 0.0 <= task_reward_sum <= v.samples):
            raise LedgerError(
                f"task_reward_sum {task_reward_sum} needs an accepted file and a value in [0, {v.samples}]"
            )
        if samples and not (v.accepted and len(samples) == v.samples):
            raise LedgerError(f"{len(samples)} sample identities need an accepted file of as many samples")
        if not 0.0 < credit_share <= 1.0:  # also refuses NaN
            raise LedgerError(f"credit_share {credit_share} is not in (0, 1]")
        share = credit_share if v.accepted else None
        if any(s.node_id != v.node_id for s in samples):  # the signer check ensures it; the key relies on it
            raise LedgerError("a sample identity names another node than the verdict's sender")
        with self.db.write() as c:
            row = c.execute(
                "SELECT verdict FROM contributions WHERE file_hash = ? AND node_id = ?",
                (v.file_hash, v.node_id),
            ).fetchone()
            if row is not None:
                return RecordResult(load_verdict(row["verdict"]), True, (), ())
            self._check_new(c, samples)  # inside the write lock: no other verdict can claim them meanwhile
            actions: tuple[Action, ...] = ()
            if v.failed_check not in UNATTRIBUTED_CHECKS:  # else the file may not be this node's at all
                self._touch(c, v.node_id, received, None)
                actions = decide(
                    self._history(c, v.node_id, v.decided_at), v, self.policy, credit_share=credit_share
                )
            c.execute(
                "INSERT INTO contributions (file_hash, node_id, step, samples, tokens, accepted,"
                " failed_check, reason, validator_id, received_at, decided_at, recorded_at, verdict,"
                " task_reward_sum, credit_share) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    v.file_hash,
                    v.node_id,
                    v.step,
                    v.samples,
                    v.tokens,
                    int(v.accepted),
                    v.failed_check,
                    v.reason,
                    v.validator_id,
                    received,
                    v.decided_at,
                    time.time(),
                    signed.to_json().decode(),
                    task_reward_sum,
                    share,
                ),
            )
            bans = self._apply(c, v, actions)
            # The key admits each identity once: a second claim fails here even if a check above were wrong.
            c.executemany(
                "INSERT INTO accepted_samples (run_id, node_id, policy_step, batch_counter, sample_index,"
                " sample_seed, file_hash) VALUES (?,?,?,?,?,?,?)",
                [(*s, v.file_hash) for s in samples],
            )
        if bans:
            logger.warning("node %s banned: %s", v.node_id[:16], "; ".join(b.reason for b in bans))
        return RecordResult(signed, False, actions, bans)

    def verdict_for(self, file_hash: str, node_id: str) -> Signed[Verdict] | None:
        """The verdict recorded on this sender's file, if any (check before verifying a received file)."""
        with self.db.read() as c:
            row = c.execute(
                "SELECT verdict FROM contributions WHERE file_hash = ? AND node_id = ?", (file_hash, node_id)
            ).fetchone()
        return None if row is None else load_verdict(row["verdict"])

    def verdicts_for(self, file_hash: str, limit: int = 2) -> list[Signed[Verdict]]:
        """Up to `limit` verdicts on these bytes, whoever sent them, oldest first (hash-only API route)."""
        with self.db.read() as c:
            rows = c.execute(
                "SELECT verdict FROM contributions WHERE file_hash = ? ORDER BY recorded_at LIMIT ?",
                (file_hash, limit),
            ).fetchall()
        return [load_verdict(r["verdict"]) for r in rows]

    def accepted_holder(self, samples: Sequence[SampleId]) -> tuple[SampleId, str] | None:
        """The first of `samples` already accepted, with the hash of the file that holds it; None if none is.

        A read, for the early check before a file is verified; `record` checks again under the write lock.
        """
        with self.db.read() as c:
            return self._holder(c, samples)

    @staticmethod
    def _holder(c: sqlite3.Connection, samples: Sequence[SampleId]) -> tuple[SampleId, str] | None:
        for s in samples:
            row = c.execute(
                "SELECT file_hash FROM accepted_samples WHERE run_id = ? AND node_id = ? AND policy_step = ?"
                " AND batch_counter = ? AND sample_index = ? AND sample_seed = ?",
                tuple(s),
            ).fetchone()
            if row is not None:
                return s, row["file_hash"]
        return None

    def _check_new(self, c: sqlite3.Connection, samples: Sequence[SampleId]) -> None:
        repeat = first_repeat(samples)
        if repeat is not None:
            raise DuplicateWork(samples[repeat[1]], None)
        held = self._holder(c, samples)
        if held is not None:
            raise DuplicateWork(*held)

    def _apply(self, c: sqlite3.Connection, v: Verdict, actions: Sequence[Action]) -> tuple[BanEntry, ...]:
        bans: list[BanEntry] = []
        for action in actions:
            if isinstance(action, Credit):
                c.execute("UPDATE nodes SET score = score + ? WHERE node_id = ?", (action.amount, v.node_id))
            elif isinstance(action, Slash):
                c.execute(
                    "INSERT INTO slashes"
                    " (node_id, file_hash, amount, check_class, failed_check, reason, created_at)"
                    " VALUES (?,?,?,?,?,?,?)",
                    (
                        v.node_id,
                        v.file_hash,
                        action.amount,
                        action.check_class.value,
                        action.failed_check,
                        action.reason,
                        v.decided_at,
                    ),
                )
                c.execute("UPDATE nodes SET score = score - ? WHERE node_id = ?", (action.amount, v.node_id))
            elif isinstance(action, Ban):
                bans.append(
                    self._insert_ban(c, v.node_id, action.reason, v.decided_at, action.until, v.file_hash)
                )
        return tuple(bans)

    def _history(self, c: sqlite3.Connection, node_id: str, now: float) -> NodeHistory:
        score = c.execute("SELECT score FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
        rejections = c.execute(
            "SELECT decided_at, failed_check FROM contributions"
            " WHERE node_id = ? AND accepted = 0 AND decided_at >= ?"
            " ORDER BY decided_at",
            (node_id, now - self.policy.fault_window_s),
        ).fetchall()
        # A ban the operator lifted was a mistake: it does not count towards escalation.
        count, last = c.execute(
            "SELECT COUNT(*), MAX(created_at) FROM bans WHERE node_id = ? AND lifted_at IS NULL", (node_id,)
        ).fetchone()
        active = self._active_ban(c, node_id, now)
        return NodeHistory(
            score=score["score"] if score else 0.0,
            recent_rejections=tuple(PastRejection(r["decided_at"], r["failed_check"]) for r in rejections),
            bans_so_far=count,
            last_ban_at=last,
            banned=active is not None,
            banned_until=active.until if active else None,
        )

    def history(self, node_id: str, now: float | None = None) -> NodeHistory:
        with self.db.read() as c:
            return self._history(c, node_id, time.time() if now is None else now)

    # -- nodes ------------------------------------------------------------------------------------------

    def touch_node(
        self, node_id: str, *, seen_at: float | None = None, hardware: dict[str, Any] | None = None
    ) -> None:
        """Note that a node was seen (e.g. its signed heartbeat), with its hardware if given."""
        check_node_id(node_id)
        hardware_json = None if hardware is None else hardware_to_json(hardware)
        with self.db.write() as c:
            self._touch(c, node_id, time.time() if seen_at is None else seen_at, hardware_json)

    @staticmethod
    def _touch(c: sqlite3.Connection, node_id: str, seen_at: float, hardware_json: str | None) -> None:
        c.execute(
            "INSERT INTO nodes (node_id, first_seen, last_seen, hardware) VALUES (?, ?, ?, COALESCE(?, '{}'))"
            " ON CONFLICT (node_id) DO UPDATE SET last_seen = MAX(last_seen, excluded.last_seen),"
            " hardware = COALESCE(?, hardware)",
            (node_id, seen_at, seen_at, hardware_json, hardware_json),
        )

    # -- bans -------------------------------------------------------------------------------------------

    def ban(self, node_id: str, reason: str, *, until: float | None, at: float | None = None) -> BanEntry:
        """An operator's ban (or one learnt from another validator); `until` None is permanent."""
        check_node_id(node_id)
        at = time.time() if at is None else at
        if not 0 < len(reason) <= MAX_BAN_REASON_CHARS:
            raise LedgerError(
                f"a ban reason has 1 to {MAX_BAN_REASON_CHARS} characters (it travels in the DHT)"
            )
        if until is not None and until <= at:
            raise LedgerError(f"ban end {until} is not after its start {at}")
        with self.db.write() as c:
            self._touch(c, node_id, at, None)
            return self._insert_ban(c, node_id, reason, at, until, None)

    def lift_bans(self, node_id: str, at: float | None = None) -> int:
        """End every active ban of a node now; returns how many were lifted."""
        at = time.time() if at is None else at
        with self.db.write() as c:
            cur = c.execute(
                "UPDATE bans SET lifted_at = ?"
                " WHERE node_id = ? AND lifted_at IS NULL AND (until IS NULL OR until > ?)",
                (at, node_id, at),
            )
            return cur.rowcount

    def attach_ban_record(self, ban_id: int, signed: Signed[BanRecord]) -> None:
        """Keep the operator-signed record of a ban, so it can be republished as it was signed."""
        with self.db.write() as c:
            cur = c.execute("UPDATE bans SET record = ? WHERE id = ?", (signed.to_json().decode(), ban_id))
            if cur.rowcount != 1:
                raise LedgerError(f"no ban with id {ban_id}")

    def active_ban(self, node_id: str, now: float | None = None) -> BanEntry | None:
        with self.db.read() as c:
            return self._active_ban(c, node_id, time.time() if now is None else now)

    def active_bans(self, now: float | None = None) -> list[BanEntry]:
        """Every ban in force (to republish in the DHT and to refuse files early)."""
        now = time.time() if now is None else now
        with self.db.read() as c:
            rows = c.execute(
                "SELECT * FROM bans WHERE lifted_at IS NULL AND (until IS NULL OR until > ?) ORDER BY id",
                (now,),
            ).fetchall()
        return [ban_entry(r) for r in rows]

    @staticmethod
    def _active_ban(c: sqlite3.Connection, node_id: str, now: float) -> BanEntry | None:
        # The ban that ends last (a permanent one first) is the one in force.
        row = c.execute(
            "SELECT * FROM bans WHERE node_id = ? AND lifted_at IS NULL AND (until IS NULL OR until > ?)"
            " ORDER BY until IS NULL DESC, until DESC LIMIT 1",
            (node_id, now),
        ).fetchone()
        return None if row is None else ban_entry(row)

    @staticmethod
    def _insert_ban(
        c: sqlite3.Connection,
        node_id: str,
        reason: str,
        at: float,
        until: float | None,
        file_hash: str | None,
    ) -> BanEntry:
        cur = c.execute(
            "INSERT INTO bans (node_id, file_hash, reason, created_at, until) VALUES (?,?,?,?,?)",
            (node_id, file_hash, reason, at, until),
        )
        return BanEntry(int(cur.lastrowid or 0), node_id, reason, at, until, None, file_hash, None)

    # -- reading ----------------------------------------------------------------------------------------

    def reward_curve(self, last_steps: int = 1000) -> list[RewardPoint]:
        """Mean task reward per policy step over the accepted files, for the newest `last_steps` steps."""
        rows = self.query(
            "SELECT step, SUM(task_reward_sum) AS total, SUM(samples) AS samples, COUNT(*) AS files"
            " FROM contributions WHERE accepted = 1 AND task_reward_sum IS NOT NULL AND samples > 0"
            " GROUP BY step ORDER BY step DESC LIMIT ?",
            (last_steps,),
        )
        return [
            RewardPoint(r["step"], r["total"] / r["samples"], r["samples"], r["files"])
            for r in reversed(rows)
        ]

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """Run one read-only query in a read transaction (the leaderboard's queries)."""
        return self.db.query(sql, params)

    def schema_version(self) -> int:
        return self.db.schema_version()
