"""The accepted files of a run, as the dataset admits them: a trusted validator's signed verdict first.

A row enters the dataset only through this chain, each link checked here, none taken from a contributor:

1. a verdict envelope read from a validator's ledger (opened read-only, so a running validator is not
   disturbed), whose Ed25519 signature verifies under a pinned validator key and which says `accepted`;
2. the file the verdict names, found in the accepted directory under the name the validator delivers it by
   (`<sha256>-<node id>.parquet`, or `<sha256>.parquet`), read with the full rollout reader (size limits,
   the node's signature over the exact bytes, the pinned schema, value bounds);
3. the file's SHA-256 and signer equal to the verdict's `file_hash` and `node_id`, its run the dataset's.

The accepted directory is a directory anything on the machine may write to, and a ledger is a file: a file
with no verdict, a verdict signed by another key, a rejected verdict, or bytes that are not those the verdict
judged are skipped and counted by reason. The validator recomputed every row's task reward and rejects a
file on any difference (proofs/checks.py RewardCheck), so the reward an accepted file carries is the
validator's recomputed reward, never merely the node's claim.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...p2p.signing import canonical_json
from ...p2p.swarm.handoff import stored_name
from ...p2p.verdicts import DocumentError, Signed, Verdict, open_signed
from ...proofs.rollout_file import RolloutFile, read_rollout_file
from ...proofs.rollout_schema import RolloutFileError, RolloutLimits
from .errors import DatasetError

logger = logging.getLogger(__name__)

# A ledger row's verdict column is a few hundred bytes; open_signed bounds it again (MAX_ENVELOPE_BYTES).
_ACCEPTED_SQL = (
    "SELECT file_hash, node_id, verdict FROM contributions WHERE accepted = 1 ORDER BY decided_at, file_hash"
)


@dataclass(frozen=True)
class AcceptedFile:
    """One accepted file: its verdict and its verified rows."""

    verdict: Signed[Verdict]
    verdict_id: str  # SHA-256 of the canonical JSON of the signed verdict document
    file: RolloutFile


@dataclass
class SourceReport:
    """What was found, and why anything was left out (reason -> count)."""

    accepted: int = 0
    skipped: Counter[str] = field(default_factory=Counter)

    def skip(self, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        logger.warning("dataset: leaving out %s: %s", reason, detail)


def verdict_id(signed: Signed[Verdict]) -> str:
    """The verdict's identity: what a dataset row names to trace it to the validator's decision."""
    return hashlib.sha256(canonical_json(signed.document.payload())).hexdigest()


def _ledger_rows(path: Path) -> list[tuple[str, str, str]]:
    if not path.is_file():
        raise DatasetError(f"ledger {path} does not exist (the validator's <data-dir>/ledger.sqlite)")
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
        try:
            return [(str(a), str(b), str(c)) for a, b, c in con.execute(_ACCEPTED_SQL)]
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise DatasetError(f"cannot read the ledger {path}: {exc}") from None


def accepted_verdicts(
    ledgers: Sequence[Path], trusted: frozenset[str], report: SourceReport
) -> list[Signed[Verdict]]:
    """Every accepted verdict of `ledgers` that a key in `trusted` signed, once per (file hash, sender)."""
    seen: set[tuple[str, str]] = set()
    out: list[Signed[Verdict]] = []
    for path in ledgers:
        for file_hash, node_id, envelope in _ledger_rows(Path(path)):
            try:
                signed = open_signed(envelope, Verdict, trusted)
            except DocumentError as exc:
                report.skip("untrusted-verdict", f"{path}: verdict on {file_hash[:16]}…: {exc}")
                continue
            v = signed.document
            if not v.accepted or (v.file_hash, v.node_id) != (file_hash, node_id):
                report.skip("verdict-mismatch", f"{path}: row {file_hash[:16]}… holds another verdict")
                continue
            if (v.file_hash, v.node_id) not in seen:
                seen.add((v.file_hash, v.node_id))
                out.append(signed)
    return out


def _candidates(accepted_dir: Path, v: Verdict) -> Iterator[Path]:
    yield accepted_dir / f"{stored_name(v.file_hash, v.node_id)}.parquet"
    yield accepted_dir / f"{v.file_hash}.parquet"


def accepted_files(
    ledgers: Sequence[Path],
    accepted_dir: Path,
    trusted: frozenset[str],
    run_id: str,
    limits: RolloutLimits | None = None,
) -> tuple[list[AcceptedFile], SourceReport]:
    """The files of `accepted_dir` that a trusted, accepting verdict of `ledgers` judged (module docstring)."""
    if not trusted:
        raise DatasetError("no validator key is trusted: give the validators' keys (--validator-key)")
    if not accepted_dir.is_dir():
        raise DatasetError(
            f"accepted directory {accepted_dir} does not exist (the trainer's <data-dir>/accepted)"
        )
    report = SourceReport()
    out: list[AcceptedFile] = []
    for signed in accepted_verdicts(ledgers, trusted, report):
        v = signed.document
        path = next((p for p in _candidates(accepted_dir, v) if p.is_file()), None)
        if path is None:
            report.skip("file-missing", f"no file for the verdict on {v.file_hash[:16]}… in {accepted_dir}")
            continue
        try:
            verified = read_rollout_file(path, limits, expected_signer=v.node_id)
        except RolloutFileError as exc:
            report.skip("unreadable", f"{path.name}: {exc}")
            continue
        if verified.sha256 != v.file_hash:
            report.skip("not-the-judged-bytes", f"{path.name} hashes to {verified.sha256[:16]}…")
            continue
        if any(r.run_id != run_id for r in verified.rows):
            report.skip("other-run", f"{path.name}: rows of another run than {run_id!r}")
            continue
        if any(r.policy_step != v.step for r in verified.rows) or len(verified.rows) != v.samples:
            report.skip("verdict-mismatch", f"{path.name}: step or row count differ from its verdict")
            continue
        out.append(AcceptedFile(signed, verdict_id(signed), verified))
        report.accepted += 1
    return out, report
