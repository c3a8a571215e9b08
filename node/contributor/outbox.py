"""A durable outbox of rollout files: written, signed files wait here until a validator acknowledges them.

Layout under <data-dir>/rollouts/:
  pending/<sha256>.parquet + .sig   written and signed, not yet acknowledged (resent after a restart);
                                    <sha256>.step beside them names the checkpoint step it was generated with
  sent/<sha256>.parquet + .sig      acknowledged; the receipt sits beside them as <sha256>.receipt.json
  rejected/<sha256>.parquet + .sig  refused by a validator (never resent); the reason as <sha256>.reason.json
  sent/<sha256>.verdict.json        the validator's signed verdict, once learned (node/contributor/verdicts.py);
                                    the .parquet is then deleted (the validator holds it), the rest is kept
Files are staged in tmp/ and moved into pending/ with one rename after the signature is on disk, so a crash
never leaves a half-written file that looks complete; whatever is in pending/ is complete and signed.
A validator credits a delivery (file hash, sender) once, so resending to it after an ambiguous failure is
safe; a receipted file is never sent again (node/contributor/delivery.py).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...p2p.swarm import Receipt
from ...p2p.wire import is_hex64
from ..errors import NodeError
from ..runtime.durable import fsync_path

logger = logging.getLogger(__name__)

FILE_SUFFIX = ".parquet"
SIG_SUFFIX = ".sig"
STEP_SUFFIX = ".step"
RECEIPT_SUFFIX = ".receipt.json"
VERDICT_SUFFIX = ".verdict.json"
REASON_SUFFIX = ".reason.json"


class OutboxError(NodeError):
    """The outbox directory is unusable or an entry is inconsistent."""


@dataclass(frozen=True)
class OutboxEntry:
    sha256: str
    file_path: Path
    sig_path: Path
    policy_step: int | None = None  # the checkpoint it was generated with (None: written by an older version)

    @property
    def step_path(self) -> Path:
        return self.file_path.with_name(f"{self.sha256}{STEP_SUFFIX}")


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

    def commit(
        self, sha256: str, staged_file: Path, staged_sig: Path, policy_step: int | None = None
    ) -> OutboxEntry:
        """Move a fully written file and its signature into pending/ (step and signature first, file last)."""
        if not is_hex64(sha256):
            raise OutboxError(f"not a hex SHA-256: {sha256!r}")
        entry = self._entry(self.pending, sha256)
        if policy_step is not None:
            entry = OutboxEntry(sha256, entry.file_path, entry.sig_path, policy_step)
            entry.step_path.write_text(str(policy_step))
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
            entries.append(
                OutboxEntry(entry.sha256, entry.file_path, entry.sig_path, _read_step(entry.step_path))
            )
        return entries

    def pending_count(self) -> int:
        return sum(1 for _ in self.pending.glob(f"*{FILE_SUFFIX}"))

    def drop_stale(self, entry: OutboxEntry) -> None:
        """Delete an unsent entry the trainer could no longer use (its checkpoint left the async window)."""
        for path in (entry.file_path, entry.sig_path, entry.step_path):
            path.unlink(missing_ok=True)

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
        entry.step_path.unlink(missing_ok=True)
        fsync_path(self.sent)
        return receipt_path

    def reject(self, entry: OutboxEntry, reason: str) -> None:
        """Move a refused entry out of pending/ so it is never resent; keeps it for the operator to inspect."""
        done = self._entry(self.rejected, entry.sha256)
        (self.rejected / f"{entry.sha256}{REASON_SUFFIX}").write_text(json.dumps({"reason": reason[:2000]}))
        for src, dst in ((entry.file_path, done.file_path), (entry.sig_path, done.sig_path)):
            if src.exists():
                os.replace(src, dst)
        entry.step_path.unlink(missing_ok=True)
        fsync_path(self.rejected)

    def receipts(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.sent.glob(f"*{RECEIPT_SUFFIX}"))]

    def awaiting_verdict(self) -> list[dict[str, Any]]:
        """Receipts of sent files whose verdict is not known yet, oldest first."""
        found = []
        for path in self.sent.glob(f"*{RECEIPT_SUFFIX}"):
            sha256 = path.name[: -len(RECEIPT_SUFFIX)]
            if (self.sent / f"{sha256}{VERDICT_SUFFIX}").exists():
                continue
            try:
                receipt = Receipt.model_validate_json(path.read_bytes())
            except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
                logger.warning(
                    "unreadable receipt %s (%s); its verdict will not be asked for", path.name, exc
                )
                continue
            found.append(receipt.model_dump(mode="json"))
        return sorted(found, key=lambda r: r["body"]["received_at"])

    def record_verdict(self, sha256: str, envelope: dict[str, Any]) -> None:
        """Keep the signed verdict beside the receipt (durably), then drop the file the validator holds."""
        tmp = self.tmp / f"{sha256}{VERDICT_SUFFIX}"
        tmp.write_text(json.dumps(envelope, sort_keys=True))
        fsync_path(tmp)
        os.replace(tmp, self.sent / f"{sha256}{VERDICT_SUFFIX}")
        fsync_path(self.sent)
        self._entry(self.sent, sha256).file_path.unlink(missing_ok=True)

    def verdict_counts(self) -> tuple[int, int]:
        """(accepted, rejected) over the recorded verdicts plus the files refused at hand-off."""
        accepted = rejected = 0
        for path in self.sent.glob(f"*{VERDICT_SUFFIX}"):
            try:
                verdict = json.loads(path.read_text())["document"]["accepted"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            accepted, rejected = (accepted + 1, rejected) if verdict is True else (accepted, rejected + 1)
        return accepted, rejected + len(list(self.rejected.glob(f"*{REASON_SUFFIX}")))

    def counts(self) -> dict[str, int]:
        return {
            "pending": self.pending_count(),
            "sent": len(list(self.sent.glob(f"*{RECEIPT_SUFFIX}"))),
        }

    @staticmethod
    def _entry(directory: Path, sha256: str) -> OutboxEntry:
        return OutboxEntry(sha256, directory / f"{sha256}{FILE_SUFFIX}", directory / f"{sha256}{SIG_SUFFIX}")


def _read_step(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
