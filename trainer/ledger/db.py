"""The ledger's SQLite file: connection settings, explicit transactions and schema migrations.

WAL mode lets readers (the leaderboard) run while the validator writes; the busy timeout makes a second
process wait for the write lock instead of failing. Every write is `BEGIN IMMEDIATE`: the write lock is
taken up front, so two writers never deadlock upgrading read locks. One connection is shared by the
threads of a process under a lock (async callers reach it through `asyncio.to_thread`).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import TrainerError
from .schema import CREATE_MIGRATIONS_TABLE, LATEST_VERSION, MIGRATIONS

logger = logging.getLogger(__name__)


class LedgerError(TrainerError):
    """The ledger file cannot be opened or upgraded, or a value to store is malformed."""


class LedgerSettings(BaseModel):
    """Where the ledger lives and how it waits for other writers (section `ledger` of the validator)."""

    model_config = ConfigDict(extra="forbid")

    path: Path = Field(
        Path("ledger.sqlite"), description="SQLite file; relative paths are under the data dir."
    )
    busy_timeout_s: float = Field(
        10.0, gt=0, le=600, description="How long a write waits for another writer."
    )
    synchronous: Literal["NORMAL", "FULL"] = Field(
        "FULL",
        description="FULL: a committed verdict survives power loss; NORMAL: faster, survives crashes only.",
    )


class Database:
    def __init__(self, path: Path, settings: LedgerSettings) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # isolation_level=None: no implicit transactions; every transaction here is explicit.
            self._conn = sqlite3.connect(
                self.path, timeout=settings.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            self._conn.row_factory = sqlite3.Row
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except sqlite3.Error as exc:
            raise LedgerError(
                f"cannot open ledger {self.path}: {exc}; check the path and its permissions"
            ) from exc
        if str(mode).lower() != "wal":
            self._conn.close()
            raise LedgerError(
                f"ledger {self.path} cannot use WAL mode (got {mode!r}); put it on a local disk"
            )
        self._conn.execute(f"PRAGMA busy_timeout={int(settings.busy_timeout_s * 1000)}")
        self._conn.execute(f"PRAGMA synchronous={settings.synchronous}")
        self._migrate()
        self._conn.execute("PRAGMA foreign_keys=ON")

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: everything inside commits together, or rolls back on any exception."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: the queries inside see one snapshot."""
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                yield self._conn
            finally:
                self._conn.execute("COMMIT")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self.read() as c:
            return c.execute(sql, tuple(params)).fetchall()

    def schema_version(self) -> int:
        return int(self.query("SELECT MAX(version) FROM schema_migrations")[0][0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _migrate(self) -> None:
        # Each pending migration commits with its schema_migrations row; DDL is transactional in SQLite.
        # Foreign keys are off meanwhile (the pragma is a no-op inside a transaction, so it is set before):
        # a table rebuild drops a parent table; every key is checked before the upgrade commits instead.
        self._conn.execute("PRAGMA foreign_keys=OFF")
        with self.write() as c:
            c.execute(CREATE_MIGRATIONS_TABLE)
            current = c.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[0]
            if current > LATEST_VERSION:
                raise LedgerError(
                    f"ledger {self.path} has schema version {current}, newer than this prime-node knows "
                    f"({LATEST_VERSION}); upgrade prime-node"
                )
            for migration in MIGRATIONS:
                if migration.version <= current:
                    continue
                for statement in migration.statements:
                    c.execute(statement)
                c.execute(
                    "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                    (migration.version, migration.name, time.time()),
                )
                logger.info(
                    "ledger %s: applied migration %d (%s)", self.path, migration.version, migration.name
                )
            broken = c.execute("PRAGMA foreign_key_check").fetchall() if current < LATEST_VERSION else []
            if broken:
                raise LedgerError(
                    f"ledger {self.path}: the upgrade to version {LATEST_VERSION} would leave "
                    f"{len(broken)} rows breaking a foreign key (first: {tuple(broken[0])}); it was rolled "
                    f"back, the ledger is unchanged at version {current}"
                )
