"""The trainer's inbox: accepted rollout files `<sha256>-<node_id>.parquet` + `.parquet.sig` from validators.

Two formats arrive: rollout files (v2), and the last stage's file of a pipelined group whose batch was accepted
(proofs/pipeline/stage_file.py, v3): it holds every column of a rollout file for the group's samples, their
rewards the ones the validator recomputed and checked. A validator forwards only that stage's file of a group
(trainer/validator/service.py); every other member's file holds the same samples under its own node id, so the
inbox refuses any but the last stage's, and the group's samples are trained on once.

The validator (trainer/validator/spool.py `deliver`) writes the signature first and renames the Parquet file into place
last, so a `*.parquet` seen here is complete. Even so every file is read with the full reader
(proofs/rollout_file.py: size limits, the node's signature over the exact bytes, the pinned schema, value
bounds) before its rows reach the trainer: the inbox is a directory on disk that anything on the machine may
write to, and a file's name is not its identity, its verified SHA-256 is.

A file that fails to read is logged once and skipped (it stays on disk for the operator to inspect); files are
offered oldest first (by modification time, then name), the order in which the validator accepted them.
Each sample carries its identity (proofs/work_identity.py), by which the batch buffer and its consumed record
use every sample at most once, even when two validators each accepted a file carrying it. A file that repeats
a sample within itself is refused (no validator accepts one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ...proofs.pipeline.stage_file import read_stage_file
from ...proofs.rollout_file import (
    MAX_SIG_BYTES,
    SIG_SUFFIX,
    envelope_group,
    parse_envelope,
    read_bounded,
    read_rollout_file,
    signature_path,
)
from ...proofs.rollout_schema import RolloutFileError, RolloutLimits, RolloutRow
from ...proofs.work_identity import first_repeat, sample_ids
from .batch_buffer import RolloutRecord, RolloutSample

logger = logging.getLogger(__name__)

FILE_GLOB = "*.parquet"


def record_from_rows(sha256: str, rows: tuple) -> RolloutRecord:
    """A RolloutRecord of a verified file; a group is one task index (one prompt) within the file."""
    steps = {r.policy_step for r in rows}
    if len(steps) != 1:
        raise RolloutFileError(
            f"rows name {len(steps)} policy steps; a rollout file comes from one checkpoint", check="bounds"
        )
    ids = sample_ids(rows)
    repeat = first_repeat(ids)
    if repeat is not None:
        raise RolloutFileError(
            f"row {repeat[1]} repeats row {repeat[0]} ({ids[repeat[1]].describe()})", check="duplicate"
        )
    samples = tuple(
        RolloutSample(
            prompt_key=str(r.sample_index),
            prompt_ids=tuple(r.prompt_ids),
            completion_ids=tuple(r.output_ids),
            task_reward=float(r.task_reward),
            length_penalty=float(r.length_penalty),
            sample_id=identity.key(),
        )
        for r, identity in zip(rows, ids, strict=True)
    )
    return RolloutRecord(file_id=sha256, policy_step=steps.pop(), samples=samples)


def read_accepted(path: Path, limits: RolloutLimits) -> tuple[str, tuple[RolloutRow, ...]]:
    """(SHA-256, rows) of an accepted file, fully verified: a rollout file, or a group's last stage's file."""
    envelope = parse_envelope(read_bounded(signature_path(path), MAX_SIG_BYTES, "signature file"))
    if envelope_group(envelope) is None:
        verified = read_rollout_file(path, limits)
        return verified.sha256, verified.rows
    stage = read_stage_file(path, limits)  # refuses a group's other kinds of file (reports)
    if not stage.last:
        raise RolloutFileError(
            f"the file of stage {stage.stage} of a {len(stage.members)}-stage group: a group's samples are "
            "trained on from its last stage's file alone (every member's holds them)",
            check="bounds",
        )
    return stage.sha256, stage.rows


@dataclass
class Inbox:
    """Lists and reads the accepted files of one run; remembers files already handled in this process."""

    directory: Path
    run_id: str
    limits: RolloutLimits = field(default_factory=RolloutLimits)
    # The temperature the trainer's log-probabilities assume; rows sampled at another one would be trained on
    # as if drawn from a distribution they were not (validators pin it too: this guards a misconfigured one).
    temperature: float | None = None
    _done: set[str] = field(default_factory=set)  # file names fully handed to the buffer or refused

    def pending(self) -> list[Path]:
        """Complete files not yet handled, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.glob(FILE_GLOB):
            if path.name in self._done or not Path(f"{path}{SIG_SUFFIX}").is_file():
                continue
            try:
                found.append((path.stat().st_mtime_ns, path.name, path))
            except FileNotFoundError:  # removed between glob and stat
                continue
        return [p for _, _, p in sorted(found)]

    def read(self, path: Path) -> RolloutRecord | None:
        """The file's record, or None (logged, and not offered again) when it is unreadable or foreign."""
        try:
            sha256, rows = read_accepted(path, self.limits)
            if any(r.run_id != self.run_id for r in rows):
                raise RolloutFileError(f"rows belong to another run than {self.run_id!r}", check="bounds")
            other = {r.temperature for r in rows} - {self.temperature}
            if self.temperature is not None and other:
                raise RolloutFileError(
                    f"rows were sampled at temperature {min(other)!r}, the run's is "
                    f"{self.temperature!r} (run.temperature): the validator that accepted "
                    "it does not pin the run's sampling; check its [run] section",
                    check="bounds",
                )
            return record_from_rows(sha256, rows)
        except RolloutFileError as exc:
            logger.warning("skipping accepted-rollout file %s: %s", path.name, exc)
            self.mark_done(path)
            return None

    def mark_done(self, path: Path) -> None:
        self._done.add(path.name)
