"""The contribution ledger: verdicts, credit, slashing, bans and the leaderboard (SQLite).

This is the package's public front: the validator, the devnet report and the tests import from here. The
blocking `Ledger` (ledger.py) is the implementation; `AsyncLedger` (async_ledger.py) runs it off the event
loop; slashing.py is the policy, leaderboard.py the ranking, db.py/schema.py/records.py the storage.
"""

from .async_ledger import AsyncLedger
from .db import LedgerError, LedgerSettings
from .ledger import Ledger
from .records import BanEntry, DuplicateWork, RecordResult, RewardPoint

__all__ = [
    "AsyncLedger",
    "BanEntry",
    "DuplicateWork",
    "Ledger",
    "LedgerError",
    "LedgerSettings",
    "RecordResult",
    "RewardPoint",
]
