"""The leaderboard: nodes ranked by accepted tokens, then accepted samples, read from the ledger.

Accepted tokens and samples are weighted by each file's credit share (`credited`): a pipelined group's rows count
once for the whole group, each member its stage's share, as its score does (docs/ledger.md, "Credit of pipelined
groups"); files recorded before the share existed count whole. Accepted files are counted as files.

Ties fall to the higher score, then to the node id, so the order is total and the same on every read.
Files that failed before their sender was authenticated (size, signature) are left out of a node's
counts: anyone can put a node's id on a forged file. A node's rejected files are those rejected for its own
fault or fraud: a rejection the ledger's slashing policy excuses (a checkpoint that never arrived, a pipelined
group-mate's fraud, a group no operator formed...) is not the node's doing and is not counted (`rejected`).

The rows are the API's own answer types (p2p/validator_api.py), built with `outgoing`: free text from the
ledger (reasons, hardware names) is made printable there, so the API never serves what its readers refuse.

These functions block on SQLite; async callers run them with `asyncio.to_thread` (trainer/validator/dashboard.py
does).
"""

from __future__ import annotations

import json
import sqlite3
import time

from ...p2p.validator_api import (
    MAX_TOP,
    MIN_PREFIX,
    RECENT_LIMIT,
    BanEntry,
    ContributionRow,
    LeaderboardRow,
    NodeDetail,
    SlashEntry,
)
from ...p2p.wire import HEX_DIGITS
from ..errors import TrainerError
from .ledger import Ledger
from .slashing import UNATTRIBUTED_CHECKS, CheckClass


class NodeLookupError(TrainerError):
    """A node id given for lookup is malformed, unknown, or a prefix matching several nodes."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status the dashboard answers with


_UNATTRIBUTED = tuple(sorted(UNATTRIBUTED_CHECKS))


def credited(column: str) -> str:
    """SQL: the sum of an accepted file's `column` (tokens, samples) over a group of rows, each weighted by its
    credit share (NULL before ledger version 4: whole), rounded to a whole number."""
    return f"CAST(ROUND(SUM(CASE WHEN accepted = 1 THEN {column} * COALESCE(credit_share, 1) ELSE 0 END)) AS INTEGER)"


def rejected(ledger: Ledger) -> tuple[str, tuple[str, ...]]:
    """SQL and its parameters: the count, over a group of rows, of files rejected for the sender's own fault or
    fraud. Excused rejections are told by the ledger's slashing policy, so an operator's reclassification counts;
    the names are those the ledger holds (a few distinct values), classified here rather than listed in SQL,
    because a check the policy does not name takes its `unknown_check_class`."""
    names = ledger.query("SELECT DISTINCT failed_check FROM contributions WHERE failed_check IS NOT NULL")
    excused = tuple(
        sorted(
            r["failed_check"]
            for r in names
            if ledger.policy.classify(r["failed_check"]) is CheckClass.excused
        )
    )
    if not excused:
        return "SUM(1 - accepted)", ()
    marks = ",".join("?" for _ in excused)
    return f"SUM(CASE WHEN accepted = 0 AND failed_check NOT IN ({marks}) THEN 1 ELSE 0 END)", excused


_PLACEHOLDERS = ",".join("?" for _ in _UNATTRIBUTED)

_RANKED = """
WITH agg AS (
    SELECT node_id,
           {credited_tokens} AS accepted_tokens,
           {credited_samples} AS accepted_samples,
           SUM(accepted) AS accepted_files,
           {rejected} AS rejected_files,
           MAX(CASE WHEN accepted = 1 THEN step END) AS last_step
    FROM contributions
    WHERE failed_check IS NULL OR failed_check NOT IN ({unattributed})
    GROUP BY node_id
), sl AS (
    SELECT node_id, COUNT(*) AS slashes, SUM(amount) AS slashed FROM slashes GROUP BY node_id
), ab AS (
    SELECT node_id, MAX(until IS NULL) AS permanent, MAX(until) AS until
    FROM bans WHERE lifted_at IS NULL AND (until IS NULL OR until > ?) GROUP BY node_id
), ranked AS (
    SELECT n.node_id, n.score, n.hardware, n.first_seen, n.last_seen,
           COALESCE(agg.accepted_tokens, 0) AS accepted_tokens,
           COALESCE(agg.accepted_samples, 0) AS accepted_samples,
           COALESCE(agg.accepted_files, 0) AS accepted_files,
           COALESCE(agg.rejected_files, 0) AS rejected_files,
           agg.last_step,
           COALESCE(sl.slashes, 0) AS slashes, COALESCE(sl.slashed, 0.0) AS slashed,
           ab.node_id IS NOT NULL AS banned, COALESCE(ab.permanent, 0) AS ban_permanent, ab.until AS until,
           ROW_NUMBER() OVER (
               ORDER BY COALESCE(agg.accepted_tokens, 0) DESC, COALESCE(agg.accepted_samples, 0) DESC,
                        n.score DESC, n.node_id
           ) AS rank
    FROM nodes n
    LEFT JOIN agg ON agg.node_id = n.node_id
    LEFT JOIN sl ON sl.node_id = n.node_id
    LEFT JOIN ab ON ab.node_id = n.node_id
)
SELECT * FROM ranked
"""


def _ranked(ledger: Ledger, now: float) -> tuple[str, tuple[object, ...]]:
    """The ranking's SQL (to be followed by a WHERE, ORDER BY or LIMIT) and its parameters up to there."""
    count, excused = rejected(ledger)
    sql = _RANKED.format(
        credited_tokens=credited("tokens"),
        credited_samples=credited("samples"),
        rejected=count,
        unattributed=_PLACEHOLDERS,
    )
    return sql, (*excused, *_UNATTRIBUTED, now)


def leaderboard(ledger: Ledger, *, top: int = 100, now: float | None = None) -> list[LeaderboardRow]:
    """The first `top` nodes of the ranking."""
    if not 1 <= top <= MAX_TOP:
        raise NodeLookupError(f"top must be between 1 and {MAX_TOP}, got {top}", 400)
    now = time.time() if now is None else now
    sql, params = _ranked(ledger, now)
    rows = ledger.query(sql + " ORDER BY rank LIMIT ?", (*params, top))
    return [_row(r) for r in rows]


def node_detail(ledger: Ledger, node_id: str, *, now: float | None = None) -> NodeDetail:
    """One node's row (with its rank) and its recent verdicts, slashes and bans; `node_id` may be a prefix."""
    prefix = _prefix(node_id)
    now = time.time() if now is None else now
    sql, params = _ranked(ledger, now)
    rows = ledger.query(
        sql + " WHERE node_id >= ? AND node_id < ? ORDER BY rank LIMIT 2", (*params, prefix, prefix + "g")
    )
    if not rows:
        raise NodeLookupError(f"no node {prefix} in the ledger", 404)
    if len(rows) > 1:
        raise NodeLookupError(f"node id prefix {prefix} matches several nodes; give more digits", 409)
    row = _row(rows[0])
    recent = ledger.query(
        "SELECT file_hash, step, samples, tokens, accepted, failed_check, reason, decided_at"
        " FROM contributions"
        f" WHERE node_id = ? AND (failed_check IS NULL OR failed_check NOT IN ({_PLACEHOLDERS}))"
        " ORDER BY decided_at DESC LIMIT ?",
        (row.node_id, *_UNATTRIBUTED, RECENT_LIMIT),
    )
    slashes = ledger.query(
        "SELECT file_hash, amount, check_class, failed_check, reason, created_at"
        " FROM slashes WHERE node_id = ?"
        " ORDER BY created_at DESC LIMIT ?",
        (row.node_id, RECENT_LIMIT),
    )
    bans = ledger.query(
        "SELECT id, reason, created_at, until, lifted_at, file_hash FROM bans"
        " WHERE node_id = ? ORDER BY id DESC LIMIT ?",
        (row.node_id, RECENT_LIMIT),
    )
    return NodeDetail.outgoing(
        node=row,
        ranked=ranked_count(ledger),
        recent=[ContributionRow.outgoing(**{**dict(r), "accepted": bool(r["accepted"])}) for r in recent],
        slash_log=[SlashEntry.outgoing(**dict(r)) for r in slashes],
        bans=[BanEntry.outgoing(**dict(r)) for r in bans],
    )


def resolve_node(ledger: Ledger, node_id: str) -> str:
    """The full id of the one node `node_id` names (an id or a unique prefix); NodeLookupError otherwise."""
    prefix = _prefix(node_id)
    rows = ledger.query(
        "SELECT node_id FROM nodes WHERE node_id >= ? AND node_id < ? ORDER BY node_id LIMIT 2",
        (prefix, prefix + "g"),
    )
    if not rows:
        raise NodeLookupError(f"no node {prefix} in the ledger", 404)
    if len(rows) > 1:
        raise NodeLookupError(f"node id prefix {prefix} matches several nodes; give more digits", 409)
    return str(rows[0]["node_id"])


def _prefix(node_id: str) -> str:
    prefix = node_id.lower()
    if not MIN_PREFIX <= len(prefix) <= 64 or not set(prefix) <= HEX_DIGITS:
        raise NodeLookupError(f"node id must be {MIN_PREFIX} to 64 hex digits, got {node_id[:80]!r}", 400)
    return prefix


def ranked_count(ledger: Ledger) -> int:
    """How many nodes the ranking has (every node in the ledger has a rank)."""
    return int(ledger.query("SELECT COUNT(*) AS n FROM nodes")[0]["n"])


def _row(r: sqlite3.Row) -> LeaderboardRow:
    return LeaderboardRow.outgoing(
        rank=r["rank"],
        node_id=r["node_id"],
        accepted_tokens=r["accepted_tokens"],
        accepted_samples=r["accepted_samples"],
        accepted_files=r["accepted_files"],
        rejected_files=r["rejected_files"],
        score=r["score"],
        slashes=r["slashes"],
        slashed=r["slashed"],
        banned=bool(r["banned"]),
        ban_permanent=bool(r["ban_permanent"]),
        banned_until=None if r["ban_permanent"] else r["until"],
        last_step=r["last_step"],
        first_seen=r["first_seen"],
        last_seen=r["last_seen"],
        hardware=json.loads(r["hardware"]),
    )
