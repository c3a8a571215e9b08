"""A durable outbox of rollout files: written, signed files wait here until a validator acknowledges them.

Layout under <data-dir>/rollouts/:
  pending/<sha256>.parquet + .sig   written and signed, not yet acknowledged (resent after a restart)
  sent/<sha256>.parquet + .sig      acknowledged; the receipt sits beside them as <sha256>.receipt.json
  rejected/<sha256>.parquet + .sig  refused by a validator (never resent); the reason as <sha256>.reason.json
Files are staged in tmp/ and moved into pending/ with one rename after the signature is on disk, so a crash
never leaves a half-written file that looks complete; whatever is in pending/ is complete and signed.
The validator credits each file hash once, so resending after an ambiguous failure is safe.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..durable import fsync_path
from ..errors import NodeError

logger = logging.getLogger(__name__)

FILE_SUFFIX = ".parquet"
SIG_SUFFIX = ".sig"
RECEIPT_SUFFIX = ".receipt.json"


class OutboxError(NodeError):
    """The outbox directory is unusable or an entry is inconsistent."""


@dataclass(frozen=True)
class OutboxEntry:
    sha256: str
    file_path: Path
    sig_path: Path


class Outbox:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.tmp = self.root / "tmp"
        self.pending = self.root / "pending"
        self.sent = self.root / "sent"
        self.rejected = self.root / "rejected"
        for d in (self.tmp, self.pending, self.sent, self.rejected):
            d.mkdir(parents=True, exist_ok=True)
        for leftover in self.tmp.iterdir():  # staged by a process that died before committing
            leftover.unlink()

    def staging_path(self, name: str) -> Path:
        """Where to write a new file before `commit`; never looks complete to a reader."""
        return self.tmp / name

    def commit(self, sha256: str, staged_file: Path, staged_sig: Path) -> OutboxEntry:
        """Move a fully written file and its signature into pending/ (signature first, file last)."""
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise OutboxError(f"not a hex SHA-256: {sha256!r}")
        entry = self._entry(self.pending, sha256)
        for staged in (staged_file, staged_sig):
            fsync_path(staged)
        os.replace(staged_sig, entry.sig_path)
        os.replace(staged_file, entry.file_path)  # the file's presence marks the entry complete
        fsync_path(self.pending)
        return entry

    def pending_entries(self) -> list[OutboxEntry]:
        """Complete, unacknowledged entries, oldest first (resend order after a restart)."""
        entries = []
        for file_path in sorted(self.pending.glob(f"*{FILE_SUFFIX}"), key=lambda p: p.stat().st_mtime):
            entry = self._entry(self.pending, file_path.name[: -len(FILE_SUFFIX)])
            if not entry.sig_path.exists():
                logger.warning("outbox entry %s has no signature; discarding it", file_path.name)
                file_path.unlink()
                continue
            entries.append(entry)
        return entries

    def acknowledge(self, entry: OutboxEntry, receipt: dict[str, Any]) -> Path:
        """Record the validator's receipt and move the entry to sent/; idempotent."""
        done = self._entry(self.sent, entry.sha256)
        receipt_path = self.sent / f"{entry.sha256}{RECEIPT_SUFFIX}"
        tmp = self.tmp / f"{entry.sha256}{RECEIPT_SUFFIX}"
        tmp.write_text(json.dumps(receipt, sort_keys=True))
        os.replace(tmp, receipt_path)
        if entry.file_path.exists():
            os.replace(entry.file_path, done.file_path)
        if entry.sig_path.exists():
            os.replace(entry.sig_path, done.sig_path)
        fsync_path(self.sent)
        return receipt_path

    def reject(self, entry: OutboxEntry, reason: str) -> None:
        """Move a refused entry out of pending/ so it is never resent; keeps it for the operator to inspect."""
        done = self._entry(self.rejected, entry.sha256)
        (self.rejected / f"{entry.sha256}.reason.json").write_text(json.dumps({"reason": reason[:2000]}))
        for src, dst in ((entry.file_path, done.file_path), (entry.sig_path, done.sig_path)):
            if src.exists():
                os.replace(src, dst)
        fsync_path(self.rejected)

    def receipts(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.sent.glob(f"*{RECEIPT_SUFFIX}"))]

    def counts(self) -> dict[str, int]:
        return {
            "pending": len(list(self.pending.glob(f"*{FILE_SUFFIX}"))),
            "sent": len(list(self.sent.glob(f"*{RECEIPT_SUFFIX}"))),
        }

    @staticmethod
    def _entry(directory: Path, sha256: str) -> OutboxEntry:
        return OutboxEntry(sha256, directory / f"{sha256}{FILE_SUFFIX}", directory / f"{sha256}{SIG_SUFFIX}")
