"""Per group, the lowest batch number this node has not yet signed an opening for: batch numbers never repeat.

A stage signs a stream opening per batch (group, step, batch, stage). Were a stage task to start again at batch
0 after a restart of the node, or after it left its group and rejoined the same group (the group id is the
digest of run, step and members, so a group re-formed from the same members is the same group), it would sign
other frames under an opening it had signed before: two validly signed streams of one opening that diverge,
which a neighbour holding both could present as this member's equivocation. So the number is recorded, durably,
before the opening is signed (`use`), and a stage task starts from `next_batch`.

**Which marks may be forgotten.** A mark is kept with the policy step of its group (every group is for one step,
and the step is part of its id). A mark is never dropped for lack of room while its group could still be run:
the file keeps every mark of the newest `KEEP_STEPS` steps this node has used, and only when a newer step
pushes a step below `newest - KEEP_STEPS` are that step's marks dropped, and the *floor* raised to
`newest - KEEP_STEPS` (durably, in the same file). A group of a step below the floor is refused for good
(`why_refused`, `next_batch` and `use` raise): a step that far back lies outside both windows that could still
use it (the node's `async_level` and a validator's kept checkpoints are each at most 64 steps), so an honest
group of it never comes back, and should one be signed anyway (a run restarted under the same id, an operator's
mistake) the node refuses it rather than start its batch numbers again at 0. (Before, the file kept the 1024
most recently used group ids: an evicted id formed again restarted at batch 0.) Should a single window of steps
hold more than `MAX_MARKS` groups (the file would outgrow `MAX_FILE_BYTES`), a new group is refused too, never
an old mark forgotten.

The marks live in one small JSON file in the node's state directory (replaced atomically and fsynced: a crash
leaves the old file or the new one, never a torn one). A file that cannot be read is an error naming it, not a
silent reset to batch 0, which would defeat the point. A v1 file (no steps) is read with its marks' steps
unknown: those are kept for good, never dropped by step (at most the 1024 v1 kept). With no path the marks live
in memory only (tests; a process that never restarts still never repeats a number across rejoins).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ..runtime.durable import fsync_path
from .errors import PipelineError

FORMAT = "prime-node/pipeline-batch-marks/v2"
FORMAT_V1 = "prime-node/pipeline-batch-marks/v1"
# Twice the largest window that could still use a step (`async_level` and the validator's kept checkpoint
# versions are each at most 64): a step further back than this is never run again.
KEEP_STEPS = 128
MAX_FILE_BYTES = 1 << 20
# An entry is at most ~110 bytes of JSON (a 64-hex id, a step and a batch number below 2^63): 8192 fit in 1 MiB.
MAX_MARKS = 8192


@dataclass(frozen=True)
class _Mark:
    step: int | None  # None: read from a v1 file, which did not record it (kept for good)
    next: int


class BatchMarks:
    def __init__(
        self, path: Path | None, *, keep_steps: int = KEEP_STEPS, max_marks: int = MAX_MARKS
    ) -> None:
        self.path, self.keep_steps, self.max_marks = path, keep_steps, max_marks
        self._lock = threading.Lock()  # `use` runs in worker threads
        self.floor = 0  # groups of a step below this are refused: their marks may have been dropped
        self._marks: dict[str, _Mark] = {}
        if path is not None:
            self.floor, self._marks = self._load()

    def why_refused(self, group_id: str, step: int) -> str | None:
        """None when batches of `group_id` (a group of policy step `step`) may be numbered here, else why not."""
        with self._lock:
            return self._refusal(group_id, step)

    def next_batch(self, group_id: str, step: int) -> int:
        """The first batch number of `group_id` this node has not signed an opening for (PipelineError when the
        group is refused: its mark may have been dropped)."""
        with self._lock:
            self._refuse(group_id, step)
            mark = self._marks.get(group_id)
            return 0 if mark is None else mark.next

    def use(self, group_id: str, step: int, batch: int) -> None:
        """Record that batch `batch` of `group_id` (of policy step `step`) is about to be signed; on disk before
        this returns. Drops the marks of steps more than `keep_steps` below the newest and raises the floor."""
        with self._lock:
            self._refuse(group_id, step)
            mark = self._marks.get(group_id)
            if mark is not None and batch < mark.next:
                raise PipelineError(
                    f"batch {batch} of group {group_id[:16]}… was already used (next free: {mark.next})"
                )
            if mark is not None and mark.step is not None and mark.step != step:
                raise PipelineError(
                    f"group {group_id[:16]}… is of step {mark.step}, not {step}: a group id names one step"
                )
            self._marks[group_id] = _Mark(step if mark is None else mark.step, batch + 1)
            newest = max((m.step for m in self._marks.values() if m.step is not None), default=0)
            if newest - self.keep_steps > self.floor:
                self.floor = newest - self.keep_steps
                self._marks = {g: m for g, m in self._marks.items() if m.step is None or m.step >= self.floor}
            if self.path is not None:
                self._save()

    def _refusal(self, group_id: str, step: int) -> str | None:
        if step < self.floor:
            return (
                f"its policy step {step} is below {self.floor}, the oldest step whose batch numbers this node "
                f"still keeps (it keeps {self.keep_steps} steps below the newest it used)"
            )
        if group_id not in self._marks and len(self._marks) >= self.max_marks:
            return f"this node keeps the batch numbers of {self.max_marks} groups already (none may be forgotten)"
        return None

    def _refuse(self, group_id: str, step: int) -> None:
        why = self._refusal(group_id, step)
        if why is not None:
            raise PipelineError(f"group {group_id[:16]}… refused: {why}")

    def _load(self) -> tuple[int, dict[str, _Mark]]:
        assert self.path is not None
        try:
            with self.path.open("rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return 0, {}
        if len(raw) > MAX_FILE_BYTES:
            raise PipelineError(f"{self.path}: larger than {MAX_FILE_BYTES} bytes; not a batch-marks file")
        try:
            document = json.loads(raw)
            version = document.get("format")
            if version not in (FORMAT, FORMAT_V1):
                raise ValueError(f"format is {version!r}, not {FORMAT!r}")
            marks = document["next"]
            if not isinstance(marks, list):
                raise ValueError("'next' is not a list")
            floor = document.get("floor", 0) if version == FORMAT else 0
            if not _natural(floor):
                raise ValueError(f"floor {floor!r} is not a step number")
            loaded: dict[str, _Mark] = {}
            for entry in marks:
                if version == FORMAT_V1:
                    group_id, batch = entry
                    step = None
                else:
                    group_id, step, batch = entry
                if not (isinstance(group_id, str) and _natural(batch) and (step is None or _natural(step))):
                    raise ValueError(
                        f"entry {entry!r} is not a group id, a step and a batch number (both integers >= 0)"
                    )
                loaded[group_id] = _Mark(step, batch)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise PipelineError(
                f"{self.path}: unreadable batch marks ({exc}); move it aside only if this node never signed "
                "a batch of the groups it names (it would sign their batch numbers again)"
            ) from None
        return floor, loaded

    def _save(self) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        document = {
            "format": FORMAT,
            "floor": self.floor,
            "next": [[g, m.step, m.next] for g, m in self._marks.items()],
        }
        tmp.write_text(json.dumps(document))
        fsync_path(tmp)
        os.replace(tmp, self.path)
        fsync_path(self.path.parent)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
