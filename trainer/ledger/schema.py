"""The ledger's SQLite schema as an ordered list of migrations (docs/ledger.md describes every table).

A migration is applied once, inside one write transaction together with its row in `schema_migrations`
(SQLite DDL is transactional), so a crash mid-upgrade leaves the previous version intact. Never edit a
released migration: append a new one. Migrations run with foreign keys off, as SQLite's table rebuild needs
(a new table is filled, the old one dropped, the new one renamed); trainer/ledger/db.py checks every
foreign key before the transaction commits.
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

# Version 3: a verdict belongs to (file hash, sender), not to the hash alone: two nodes may deliver the same
# bytes (one re-signing the other's file), and each gets its own verdict. SQLite cannot change a primary key
# in place, so contributions is rebuilt, and slashes and bans with it (their key into it gains the node).
_CONTRIBUTIONS_V3 = """CREATE TABLE contributions_v3 (
    file_hash       TEXT NOT NULL CHECK (length(file_hash) = 64),
    node_id         TEXT NOT NULL CHECK (length(node_id) = 64),
    step            INTEGER NOT NULL CHECK (step >= 0),
    samples         INTEGER NOT NULL CHECK (samples >= 0),
    tokens          INTEGER NOT NULL CHECK (tokens >= 0),
    accepted        INTEGER NOT NULL CHECK (accepted IN (0, 1)),
    failed_check    TEXT,
    reason          TEXT NOT NULL,
    validator_id    TEXT NOT NULL,
    received_at     REAL NOT NULL,
    decided_at      REAL NOT NULL,
    recorded_at     REAL NOT NULL,
    verdict         TEXT NOT NULL,
    task_reward_sum REAL CHECK (task_reward_sum IS NULL OR (accepted = 1 AND task_reward_sum >= 0
                                AND task_reward_sum <= samples)),
    PRIMARY KEY (file_hash, node_id),
    CHECK ((accepted = 1) = (failed_check IS NULL))
)"""
_SLASHES_V3 = """CREATE TABLE slashes_v3 (
    id           INTEGER PRIMARY KEY,
    node_id      TEXT NOT NULL REFERENCES nodes (node_id),
    file_hash    TEXT,
    amount       REAL NOT NULL CHECK (amount >= 0),
    check_class  TEXT NOT NULL CHECK (check_class IN ('fault', 'fraud')),
    failed_check TEXT NOT NULL,
    reason       TEXT NOT NULL,
    created_at   REAL NOT NULL,
    FOREIGN KEY (file_hash, node_id) REFERENCES contributions (file_hash, node_id)
)"""
_BANS_V3 = """CREATE TABLE bans_v3 (
    id         INTEGER PRIMARY KEY,
    node_id    TEXT NOT NULL REFERENCES nodes (node_id),
    file_hash  TEXT,
    reason     TEXT NOT NULL,
    created_at REAL NOT NULL,
    until      REAL CHECK (until IS NULL OR until > created_at),
    lifted_at  REAL,
    record     TEXT,
    FOREIGN KEY (file_hash, node_id) REFERENCES contributions (file_hash, node_id)
)"""
_CONTRIBUTION_COLUMNS = (
    "file_hash, node_id, step, samples, tokens, accepted, failed_check, reason, validator_id,"
    " received_at, decided_at, recorded_at, verdict, task_reward_sum"
)
_SLASH_COLUMNS = "id, node_id, file_hash, amount, check_class, failed_check, reason, created_at"
_BAN_COLUMNS = "id, node_id, file_hash, reason, created_at, until, lifted_at, record"

MIGRATIONS += (
    Migration(
        3,
        "verdicts per (file hash, sender); accepted sample identities",
        (
            _CONTRIBUTIONS_V3,
            f"INSERT INTO contributions_v3 ({_CONTRIBUTION_COLUMNS})"
            f" SELECT {_CONTRIBUTION_COLUMNS} FROM contributions",
            _SLASHES_V3,
            f"INSERT INTO slashes_v3 ({_SLASH_COLUMNS}) SELECT {_SLASH_COLUMNS} FROM slashes",
            _BANS_V3,
            f"INSERT INTO bans_v3 ({_BAN_COLUMNS}) SELECT {_BAN_COLUMNS} FROM bans",
            "DROP TABLE bans",  # children first; their indexes go with them
            "DROP TABLE slashes",
            "DROP TABLE contributions",
            "ALTER TABLE contributions_v3 RENAME TO contributions",
            "ALTER TABLE slashes_v3 RENAME TO slashes",
            "ALTER TABLE bans_v3 RENAME TO bans",
            "CREATE INDEX contributions_by_node ON contributions (node_id, decided_at)",
            "CREATE INDEX contributions_by_step ON contributions (step) WHERE accepted = 1",
            "CREATE INDEX slashes_by_node ON slashes (node_id)",
            "CREATE INDEX bans_by_node ON bans (node_id, until)",
            # Every sample of every accepted file, by what it is (proofs/work_identity.py): the key makes a
            # sample accepted at most once, whatever file carried it, checked in the transaction that records
            # the verdict. Files accepted before version 3 have no rows here (their samples were not kept).
            """CREATE TABLE accepted_samples (
                run_id        TEXT NOT NULL,
                node_id       TEXT NOT NULL,
                policy_step   INTEGER NOT NULL,
                batch_counter INTEGER NOT NULL,
                sample_index  INTEGER NOT NULL,
                sample_seed   INTEGER NOT NULL,
                file_hash     TEXT NOT NULL,
                PRIMARY KEY (run_id, node_id, policy_step, batch_counter, sample_index, sample_seed),
                FOREIGN KEY (file_hash, node_id) REFERENCES contributions (file_hash, node_id)
            ) WITHOUT ROWID""",
        ),
    ),
)

# Version 4: the share of one unit of work an accepted file was credited (`accept_credit` x share went to the
# score). 1 for a rollout file; a pipelined group's stage file earns its stage's share of the model's layers, so
# that one batch earns one unit however many stages ran it (trainer/validator/group_job.py `layer_share`).
MIGRATIONS += (
    Migration(
        4,
        "credit share of accepted files",
        (
            "ALTER TABLE contributions ADD COLUMN credit_share REAL"
            " CHECK (credit_share IS NULL OR (accepted = 1 AND credit_share > 0 AND credit_share <= 1))",
        ),
    ),
)

LATEST_VERSION = MIGRATIONS[-1].version
