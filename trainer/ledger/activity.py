"""What the swarm did lately, read from the ledger for the dashboard: per-node work in a window, the pace of
verdicts, why banned nodes are banned, and one node's accepted and rejected files per policy step.

Accepted tokens and samples are weighted by each file's credit share, as in the ranking (leaderboard.py
`credited`). Files that failed before their sender was authenticated (size, signature) are left out of a node's
counts, as in the ranking: anyone can put a node's id on a forged file; rejected files are those rejected for
the node's own fault or fraud, as in the ranking (leaderboard.py `rejected`). Free text (reasons) leaves here
through the API's `outgoing` models, made printable.

These functions block on SQLite; async callers run them with `asyncio.to_thread`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...p2p.validator_api import HISTORY_STEPS, HistoryPoint, NodeBan, NodeHistory
from .leaderboard import credited, rejected, resolve_node
from .ledger import Ledger
from .slashing import UNATTRIBUTED_CHECKS

_UNATTRIBUTED = tuple(sorted(UNATTRIBUTED_CHECKS))
_ATTRIBUTED = f"(failed_check IS NULL OR failed_check NOT IN ({','.join('?' for _ in _UNATTRIBUTED)}))"
LATENCY_OVER = 50  # newest verdicts the mean receipt-to-verdict time is taken over


@dataclass(frozen=True)
class Activity:
    """One node's verdicts decided within the window."""

    accepted_files: int
    rejected_files: int
    tokens: int
    samples: int


@dataclass(frozen=True)
class Pace:
    """How fast the validator decides: mean latency of its newest verdicts, and verdicts in the window."""

    latency_s: float | None
    latency_over: int
    verdicts: int


def recent_activity(ledger: Ledger, since: float) -> dict[str, Activity]:
    """Each node's verdicts decided at or after `since` (a node without any is absent)."""
    bad, excused = rejected(ledger)
    rows = ledger.query(
        f"SELECT node_id, SUM(accepted) AS ok, {bad} AS bad,"
        f" {credited('tokens')} AS tokens, {credited('samples')} AS samples"
        f" FROM contributions WHERE decided_at >= ? AND {_ATTRIBUTED} GROUP BY node_id",
        (*excused, since, *_UNATTRIBUTED),
    )
    return {r["node_id"]: Activity(r["ok"], r["bad"], r["tokens"], r["samples"]) for r in rows}


@dataclass(frozen=True)
class Totals:
    accepted_files: int
    rejected_files: int
    accepted_tokens: int
    accepted_samples: int


def totals(ledger: Ledger) -> Totals:
    """Every verdict in the ledger, summed (rejections for the sender's own fault only)."""
    bad, excused = rejected(ledger)
    r = ledger.query(
        f"SELECT COALESCE(SUM(accepted), 0) AS ok, COALESCE({bad}, 0) AS bad,"
        f" COALESCE({credited('tokens')}, 0) AS tokens, COALESCE({credited('samples')}, 0) AS samples"
        f" FROM contributions WHERE {_ATTRIBUTED}",
        (*excused, *_UNATTRIBUTED),
    )[0]
    return Totals(r["ok"], r["bad"], r["tokens"], r["samples"])


def verdict_pace(ledger: Ledger, since: float, last: int = LATENCY_OVER) -> Pace:
    """The mean receipt-to-verdict time of the newest `last` verdicts, and how many were decided since `since`."""
    latest = ledger.query(
        "SELECT AVG(decided_at - received_at) AS mean, COUNT(*) AS n FROM"
        " (SELECT decided_at, received_at FROM contributions ORDER BY decided_at DESC LIMIT ?)",
        (last,),
    )[0]
    window = ledger.query("SELECT COUNT(*) AS n FROM contributions WHERE decided_at >= ?", (since,))[0]
    mean = latest["mean"]
    return Pace(None if mean is None else max(0.0, float(mean)), int(latest["n"]), int(window["n"]))


def ban_causes(ledger: Ledger, now: float) -> dict[str, NodeBan]:
    """The ban in force of every banned node (the one ending last) with the node's latest slash."""
    bans = ledger.query(
        "SELECT b.node_id, b.reason, b.created_at, b.until, s.failed_check, s.reason AS slash_reason"
        " FROM bans b LEFT JOIN slashes s ON s.id ="
        " (SELECT id FROM slashes WHERE node_id = b.node_id ORDER BY created_at DESC, id DESC LIMIT 1)"
        " WHERE b.lifted_at IS NULL AND (b.until IS NULL OR b.until > ?)"
        " ORDER BY b.until IS NULL, b.until",  # the one in force last wins the dict
        (now,),
    )
    return {
        r["node_id"]: NodeBan.outgoing(
            reason=r["reason"],
            failed_check=r["failed_check"],
            slash_reason=r["slash_reason"],
            since=r["created_at"],
            until=r["until"],
        )
        for r in bans
    }


def node_history(ledger: Ledger, node_id: str, steps: int = HISTORY_STEPS) -> NodeHistory:
    """The node's accepted and rejected files per policy step, its newest `steps` steps (`node_id`: an id or a
    unique prefix, as for node_detail)."""
    node = resolve_node(ledger, node_id)
    bad, excused = rejected(ledger)
    rows = ledger.query(
        f"SELECT step, SUM(accepted) AS ok, {bad} AS bad,"
        f" {credited('tokens')} AS tokens"
        f" FROM contributions WHERE node_id = ? AND {_ATTRIBUTED}"
        " GROUP BY step ORDER BY step DESC LIMIT ?",
        (*excused, node, *_UNATTRIBUTED, steps),
    )
    points = [
        HistoryPoint(step=r["step"], accepted=r["ok"], rejected=r["bad"], tokens=r["tokens"])
        for r in reversed(rows)
    ]
    return NodeHistory(node_id=node, points=points)
