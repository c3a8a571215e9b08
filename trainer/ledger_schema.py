"""The ledger's SQLite schema as an ordered list of migrations (docs/ledger.md describes every table).

A migration is applied once, inside one write transaction together with its row in `schema_migrations`
(SQLite DDL is transactional), so a crash mid-upgrade leaves the previous version intact. Never edit a
released migration: append a new one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


CREATE_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    INTEGER PRIMARY KEY,
    name       TEXT NOT NULL,
    applied_at REAL NOT NULL
)"""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "contributions, nodes, slashes, bans",
        (
            """CREATE TABLE nodes (
                node_id    TEXT PRIMARY KEY CHECK (length(node_id) = 64),
                first_seen REAL NOT NULL,
                last_seen  REAL NOT NULL,
                hardware   TEXT NOT NULL DEFAULT '{}',
                score      REAL NOT NULL DEFAULT 0
            )""",
            # node_id is not a foreign key: a file that failed before authentication (bad signature) is
            # recorded for idempotence under the id it claims, without creating a node for that id.
            """CREATE TABLE contributions (
                file_hash    TEXT PRIMARY KEY CHECK (length(file_hash) = 64),
                node_id      TEXT NOT NULL CHECK (length(node_id) = 64),
                step         INTEGER NOT NULL CHECK (step >= 0),
                samples      INTEGER NOT NULL CHECK (samples >= 0),
                tokens       INTEGER NOT NULL CHECK (tokens >= 0),
                accepted     INTEGER NOT NULL CHECK (accepted IN (0, 1)),
                failed_check TEXT,
                reason       TEXT NOT NULL,
                validator_id TEXT NOT NULL,
                received_at  REAL NOT NULL,
                decided_at   REAL NOT NULL,
                recorded_at  REAL NOT NULL,
                verdict      TEXT NOT NULL,
                CHECK ((accepted = 1) = (failed_check IS NULL))
            )""",
            "CREATE INDEX contributions_by_node ON contributions (node_id, decided_at)",
            """CREATE TABLE slashes (
                id           INTEGER PRIMARY KEY,
                node_id      TEXT NOT NULL REFERENCES nodes (node_id),
                file_hash    TEXT REFERENCES contributions (file_hash),
                amount       REAL NOT NULL CHECK (amount >= 0),
                check_class  TEXT NOT NULL CHECK (check_class IN ('fault', 'fraud')),
                failed_check TEXT NOT NULL,
                reason       TEXT NOT NULL,
                created_at   REAL NOT NULL
            )""",
            "CREATE INDEX slashes_by_node ON slashes (node_id)",
            """CREATE TABLE bans (
                id         INTEGER PRIMARY KEY,
                node_id    TEXT NOT NULL REFERENCES nodes (node_id),
                file_hash  TEXT REFERENCES contributions (file_hash),
                reason     TEXT NOT NULL,
                created_at REAL NOT NULL,
                until      REAL CHECK (until IS NULL OR until > created_at),
                lifted_at  REAL,
                record     TEXT
            )""",
            "CREATE INDEX bans_by_node ON bans (node_id, until)",
        ),
    ),
    Migration(
        2,
        "task reward of accepted files (the reward curve)",
        (
            # Sum of the rows' task rewards, as the validator recomputed them; NULL for rejected files and
            # for files recorded before this column existed (left out of the curve, never counted as 0).
            "ALTER TABLE contributions ADD COLUMN task_reward_sum REAL"
            " CHECK (task_reward_sum IS NULL OR (accepted = 1 AND task_reward_sum >= 0"
            " AND task_reward_sum <= samples))",
            "CREATE INDEX contributions_by_step ON contributions (step) WHERE accepted = 1",
        ),
    ),
)

LATEST_VERSION = MIGRATIONS[-1].version
