"""The persistent record of the rollout groups the trainer used, so a crash neither repeats nor loses one.

Every group (one prompt's completions inside one accepted rollout file, keyed by the file's SHA-256 and the
prompt key) moves through: (absent: available) -> reserved(step) -> consumed(step), or straight to
dropped(reason) when filtering or the async window discards it. The identity of each of its samples
(proofs/work_identity.py) is recorded with it, under a key that admits an identity once: a sample reaches
training at most once even when two accepted files (say, two validators' copies in two encodings) carry it.

Exactly-once rests on two writes bracketing the checkpoint: the batch is RESERVED for step N before training
on it, and COMMITTED only after checkpoint N + 1 is durably on disk. After a crash, `recover(resume_step)`
settles the reservations the checkpoint decides: those of steps below the step the trainer resumes from
made it into a saved checkpoint (consumed); the others did not (released, to be trained on again).

SQLite in WAL mode with synchronous=FULL: a returned commit survives power loss. The trainer is the only
writer; calls are serialised by a lock so they may run in a worker thread (keep fsyncs off the event loop).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from pathlib import Path

from ..errors import TrainerError

GroupKey = tuple[str, str]  # (rollout file SHA-256, prompt key)

_SCHEMA_VERSION = "2"
_UPGRADABLE = {"1"}  # version 1 had no samples table: its groups stay as recorded, their samples unknown
_SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    file_id   TEXT NOT NULL,
    group_key TEXT NOT NULL,
    state     TEXT NOT NULL CHECK (state IN ('reserved', 'consumed', 'dropped')),
    step      INTEGER NOT NULL,
    reason    TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (file_id, group_key)
);
CREATE INDEX IF NOT EXISTS groups_by_state_step ON groups (state, step);
CREATE TABLE IF NOT EXISTS samples (
    sample_id TEXT PRIMARY KEY,
    file_id   TEXT NOT NULL,
    group_key TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS samples_by_group ON samples (file_id, group_key);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_LOOKUP_CHUNK = 500  # identities per IN (...) query, under SQLite's bound on host parameters
SampleOf = tuple[str, GroupKey]  # (sample identity key, the group it belongs to)

# The samples of reserved groups (completed by the caller's step condition and a closing parenthesis).
_FORGET_SAMPLES = (
    "DELETE FROM samples WHERE (file_id, group_key) IN"
    " (SELECT file_id, group_key FROM groups WHERE state = 'reserved'"
)


class ConsumedLedger:
    """Open (creating if needed) the record at `path`; use as a context manager or call close()."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise TrainerError(
                f"consumed-rollout record {self.path} is unreadable ({exc}); restore it from backup"
            ) from None
        if row is None or row[0] in _UPGRADABLE:
            self._db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema', ?)", (_SCHEMA_VERSION,)
            )
        elif row[0] != _SCHEMA_VERSION:
            raise TrainerError(
                f"consumed-rollout record {self.path} has schema {row[0]}, "
                f"this version reads {_SCHEMA_VERSION}"
            )

    def __enter__(self) -> ConsumedLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, *statements: tuple[str, Iterable[tuple]]) -> None:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                for sql, rows in statements:
                    self._db.executemany(sql, list(rows))
                self._db.execute("COMMIT")
            except sqlite3.IntegrityError as exc:
                self._db.execute("ROLLBACK")
                raise TrainerError(
                    f"a rollout group or sample is already reserved, consumed or dropped ({exc}); "
                    "refusing to use it twice"
                ) from None
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def state(self, key: GroupKey) -> str | None:
        """'reserved', 'consumed', 'dropped', or None when the group is still available."""
        with self._lock:
            row = self._db.execute(
                "SELECT state FROM groups WHERE file_id = ? AND group_key = ?", key
            ).fetchone()
        return None if row is None else str(row[0])

    def known(self, file_id: str) -> dict[str, str]:
        """group key -> state for every group of this file the record knows about."""
        with self._lock:
            rows = self._db.execute(
                "SELECT group_key, state FROM groups WHERE file_id = ?", (file_id,)
            ).fetchall()
        return {str(k): str(s) for k, s in rows}

    def seen_samples(self, sample_ids: Iterable[str]) -> set[str]:
        """Which of these sample identities are recorded, in any state (reserved, consumed or dropped)."""
        wanted = list(dict.fromkeys(sample_ids))
        found: set[str] = set()
        with self._lock:
            for start in range(0, len(wanted), _LOOKUP_CHUNK):
                chunk = wanted[start : start + _LOOKUP_CHUNK]
                rows = self._db.execute(
                    f"SELECT sample_id FROM samples WHERE sample_id IN ({','.join('?' * len(chunk))})", chunk
                ).fetchall()
                found.update(str(r[0]) for r in rows)
        return found

    def reserve(self, step: int, keys: Iterable[GroupKey], samples: Iterable[SampleOf] = ()) -> None:
        """Mark groups (and their samples) as being trained on at `step`; fails, writing nothing, if any group
        or sample is already recorded."""
        self._write(
            (
                "INSERT INTO groups (file_id, group_key, state, step) VALUES (?, ?, 'reserved', ?)",
                ((f, g, step) for f, g in keys),
            ),
            (
                "INSERT INTO samples (sample_id, file_id, group_key) VALUES (?, ?, ?)",
                ((sid, f, g) for sid, (f, g) in samples),
            ),
        )

    def drop(
        self, step: int, keys: Iterable[GroupKey], reason: str, samples: Iterable[SampleOf] = ()
    ) -> None:
        """Record groups (and their samples) discarded for good (zero advantage, stale, malformed);
        idempotent."""
        self._write(
            (
                "INSERT OR IGNORE INTO groups (file_id, group_key, state, step, reason) "
                "VALUES (?, ?, 'dropped', ?, ?)",
                ((f, g, step, reason) for f, g in keys),
            ),
            (
                "INSERT OR IGNORE INTO samples (sample_id, file_id, group_key) VALUES (?, ?, ?)",
                ((sid, f, g) for sid, (f, g) in samples),
            ),
        )

    def commit(self, step: int) -> int:
        """Reservations of `step` become consumed; call only once checkpoint step + 1 is durable."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE groups SET state = 'consumed' WHERE state = 'reserved' AND step = ?", (step,)
            )
            return cur.rowcount

    def release(self, step: int) -> int:
        """Forget the reservations of `step` (training on them failed); the groups become available again."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(_FORGET_SAMPLES + " AND step = ?)", (step,))
            cur = self._db.execute("DELETE FROM groups WHERE state = 'reserved' AND step = ?", (step,))
            self._db.execute("COMMIT")
            return cur.rowcount

    def recover(self, resume_step: int) -> tuple[int, int]:
        """Settle reservations left by a crash: (committed, released) counts.

        A reservation of step s trained weights s into s + 1; if the trainer resumes from a checkpoint at
        resume_step > s, that update is saved, so the groups are consumed; otherwise they are released.
        """
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            done = self._db.execute(
                "UPDATE groups SET state = 'consumed' WHERE state = 'reserved' AND step < ?", (resume_step,)
            ).rowcount
            self._db.execute(_FORGET_SAMPLES + ")")
            undone = self._db.execute("DELETE FROM groups WHERE state = 'reserved'").rowcount
            self._db.execute("COMMIT")
        return done, undone

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall()
        out = {"reserved": 0, "consumed": 0, "dropped": 0}
        out.update({str(s): int(n) for s, n in rows})
        return out
