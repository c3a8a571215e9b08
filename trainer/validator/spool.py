"""The validator's spool: received rollout files made durable before they are acknowledged.

The swarm hand-off (p2p/swarm/handoff.py) writes `<sha256>-<node_id>.parquet.sig` then
`<sha256>-<node_id>.parquet` into the spool directory and calls the validator back before it sends the
receipt; `make_durable` fsyncs both files and the directory there, so a receipt is only ever sent for a file
that survives a crash. A file is one sender's delivery of some bytes: two senders of the same bytes (one
re-signing the other's file) have two entries and get two verdicts. A spooled file stays until its verdict
is recorded in the ledger (and, if accepted, it was copied to the trainer's inbox); after a restart every
spooled file is verdict-less or finishing, never lost. Entries named `<sha256>.parquet` (written before
deliveries were keyed by sender) are still recovered; their sender is read from their signature.

All functions block (disk I/O): call them from a worker thread.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...node.runtime.durable import fsync_path
from ...p2p.swarm.handoff import stored_name

logger = logging.getLogger(__name__)

FILE_SUFFIX = ".parquet"
SIG_SUFFIX = ".parquet.sig"
_NAME_RE = re.compile(r"([0-9a-f]{64})-([0-9a-f]{64})\.parquet")
_LEGACY_NAME_RE = re.compile(r"([0-9a-f]{64})\.parquet")


@dataclass(frozen=True)
class SpooledFile:
    sha256: str
    node_id: str | None  # the sender; None for a legacy entry until its signature is read
    path: Path

    @property
    def sig_path(self) -> Path:
        return self.path.with_name(self.path.name[: -len(FILE_SUFFIX)] + SIG_SUFFIX)


class Spool:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def entry(self, sha256: str, node_id: str) -> SpooledFile:
        return SpooledFile(sha256, node_id, self.directory / (stored_name(sha256, node_id) + FILE_SUFFIX))

    def make_durable(self, sha256: str, node_id: str) -> SpooledFile:
        """fsync a freshly received file, its signature, and the directory entries naming them."""
        entry = self.entry(sha256, node_id)
        fsync_path(entry.sig_path)
        fsync_path(entry.path)
        fsync_path(self.directory)
        return entry

    def recover(self) -> list[SpooledFile]:
        """Complete spooled files, oldest first; debris of interrupted receptions is removed."""
        found: list[tuple[float, SpooledFile]] = []
        for path in self.directory.iterdir():
            if path.name.startswith(".incoming-"):  # a reception that never finished: never acknowledged
                path.unlink(missing_ok=True)
                continue
            match = _NAME_RE.fullmatch(path.name)
            legacy = _LEGACY_NAME_RE.fullmatch(path.name)
            if match is not None:
                entry = SpooledFile(match.group(1), match.group(2), path)
            elif legacy is not None:
                entry = SpooledFile(legacy.group(1), None, path)
            else:
                continue
            if not entry.sig_path.is_file():  # cannot happen with the hand-off's write order; be safe
                logger.warning("spooled file %s has no signature beside it; removing it", path.name)
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime, entry))
        for path in self.directory.glob("*" + SIG_SUFFIX):
            if not path.with_name(path.name[: -len(SIG_SUFFIX)] + FILE_SUFFIX).exists():
                path.unlink(missing_ok=True)  # a signature whose file never arrived
        return [entry for _, entry in sorted(found, key=lambda pair: pair[0])]

    def remove(self, entry: SpooledFile) -> None:
        # File first: a signature left alone is debris that recover() cleans, a file left alone is not.
        entry.path.unlink(missing_ok=True)
        entry.sig_path.unlink(missing_ok=True)


def deliver(entry: SpooledFile, inbox: Path) -> Path:
    """Copy an accepted file and its signature into the trainer's inbox, durably and atomically.

    The signature goes first and the file is renamed into place last, so a reader of the inbox that sees
    `<sha>.parquet` always finds it complete with its signature. Idempotent (a rerun after a crash).
    """
    inbox.mkdir(parents=True, exist_ok=True)
    final = inbox / entry.path.name
    for source, name in ((entry.sig_path, entry.sig_path.name), (entry.path, entry.path.name)):
        target = inbox / name
        if target.exists():
            continue
        tmp = inbox / f".tmp-{name}"
        with open(source, "rb") as fin, open(tmp, "wb") as fout:
            while block := fin.read(1 << 20):
                fout.write(block)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, target)
    fsync_path(inbox)
    return final
