"""Per group, the lowest batch number this node has not yet signed an opening for: batch numbers never repeat.

A stage signs a stream opening per batch (group, step, batch, stage). Were a stage task to start again at batch
0 after a restart of the node, or after it left its group and rejoined the same group (the group id is the
digest of run, step, members and layout, so a group re-formed from the same members is the same group), it would sign
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

**Per run.** Marks and floors are kept per run id: a node that reached step 500 in one run and then joins another
run with the same data directory starts that run with its own floor (0), not the first run's 372 (a group id
names its run, so the runs' marks never meet). A v1 or v2 file (written before marks were kept per run) is read
with its marks and floor of an unknown run: its marks are kept under their group ids for whichever run uses them
(a group id is its own run's alone) and its floor keeps applying to every run, never raised, since nothing says
which run it came from (a node moving to a new run with such a file is still refused below that one floor; moving
the file aside is safe once no group of the old run can be formed again).

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
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.durable import fsync_path
from .errors import PipelineError

FORMAT = "prime-node/pipeline-batch-marks/v3"
FORMAT_V2 = "prime-node/pipeline-batch-marks/v2"
FORMAT_V1 = "prime-node/pipeline-batch-marks/v1"
# Twice the largest window that could still use a step (`async_level` and the validator's kept checkpoint
# versions are each at most 64): a step further back than this is never run again.
KEEP_STEPS = 128
MAX_FILE_BYTES = 1 << 20
# An entry is at most ~110 bytes of JSON (a 64-hex id, a step and a batch number below 2^63): 8192 fit in 1 MiB.
# Runs count as entries too (a run id is at most 64 characters, p2p/names.py; a file's at most MAX_RUN_ID), so
# the bound holds for the file.
MAX_MARKS = 8192
MAX_RUN_ID = 128


@dataclass(frozen=True)
class _Mark:
    step: int | None  # None: read from a v1 file, which did not record it (kept for good)
    next: int


@dataclass
class _Run:
    floor: int = 0  # this run's groups of a step below this are refused: their marks may have been dropped
    marks: dict[str, _Mark] = field(default_factory=dict)


class BatchMarks:
    def __init__(
        self, path: Path | None, *, keep_steps: int = KEEP_STEPS, max_marks: int = MAX_MARKS
    ) -> None:
        self.path, self.keep_steps, self.max_marks = path, keep_steps, max_marks
        self._lock = threading.Lock()  # `use` runs in worker threads
        self._runs: dict[str, _Run] = {}
        # A v1/v2 file's floor and marks, of a run it did not name (see the module's docstring, "Per run").
        self.legacy = _Run()
        if path is not None:
            self._runs, self.legacy = self._load()

    def floor(self, run_id: str) -> int:
        """The step below which groups of `run_id` are refused."""
        with self._lock:
            return self._floor(run_id)

    def why_refused(self, run_id: str, group_id: str, step: int) -> str | None:
        """None when batches of `group_id` (a group of run `run_id` at policy step `step`) may be numbered here,
        else why not."""
        with self._lock:
            return self._refusal(run_id, group_id, step)

    def next_batch(self, run_id: str, group_id: str, step: int) -> int:
        """The first batch number of `group_id` (of run `run_id`) this node has not signed an opening for
        (PipelineError when the group is refused: its mark may have been dropped)."""
        with self._lock:
            self._refuse(run_id, group_id, step)
            mark = self._mark(run_id, group_id)
            return 0 if mark is None else mark.next

    def use(self, run_id: str, group_id: str, step: int, batch: int) -> None:
        """Record that batch `batch` of `group_id` (of run `run_id`, policy step `step`) is about to be signed; on
        disk before this returns. Drops the run's marks of steps more than `keep_steps` below its newest and
        raises its floor."""
        with self._lock:
            self._refuse(run_id, group_id, step)
            mark = self._mark(run_id, group_id)
            if mark is not None and batch < mark.next:
                raise PipelineError(
                    f"batch {batch} of group {group_id[:16]}… was already used (next free: {mark.next})"
                )
            if mark is not None and mark.step is not None and mark.step != step:
                raise PipelineError(
                    f"group {group_id[:16]}… is of step {mark.step}, not {step}: a group id names one step"
                )
            run = self._runs.setdefault(run_id, _Run())
            self.legacy.marks.pop(group_id, None)  # a group id is its run's alone: the mark moves to its run
            run.marks[group_id] = _Mark(step if mark is None else mark.step, batch + 1)
            newest = max((m.step for m in run.marks.values() if m.step is not None), default=0)
            if newest - self.keep_steps > run.floor:
                run.floor = newest - self.keep_steps
                run.marks = {g: m for g, m in run.marks.items() if m.step is None or m.step >= run.floor}
            if self.path is not None:
                self._save()

    def _floor(self, run_id: str) -> int:
        run = self._runs.get(run_id)
        return max(self.legacy.floor, run.floor if run is not None else 0)

    def _mark(self, run_id: str, group_id: str) -> _Mark | None:
        run = self._runs.get(run_id)
        found = run.marks.get(group_id) if run is not None else None
        return found if found is not None else self.legacy.marks.get(group_id)

    def _entries(self) -> int:
        return len(self._runs) + sum(len(r.marks) for r in self._runs.values()) + len(self.legacy.marks)

    def _refusal(self, run_id: str, group_id: str, step: int) -> str | None:
        if not 1 <= len(run_id) <= MAX_RUN_ID:
            return f"its run id is {len(run_id)} characters; 1..{MAX_RUN_ID} are kept"
        floor = self._floor(run_id)
        if step < floor:
            return (
                f"its policy step {step} is below {floor}, the oldest step of run {run_id!r} whose batch numbers "
                f"this node still keeps (it keeps {self.keep_steps} steps below the newest it used)"
            )
        if self._mark(run_id, group_id) is None:
            new = 1 if run_id in self._runs else 2  # the mark, and the run's entry if it has none yet
            if self._entries() + new > self.max_marks:
                return (
                    f"this node keeps the batch numbers of {self._entries()} groups and runs already, "
                    f"at most {self.max_marks} (none may be forgotten)"
                )
        return None

    def _refuse(self, run_id: str, group_id: str, step: int) -> None:
        why = self._refusal(run_id, group_id, step)
        if why is not None:
            raise PipelineError(f"group {group_id[:16]}… refused: {why}")

    def _load(self) -> tuple[dict[str, _Run], _Run]:
        assert self.path is not None
        try:
            with self.path.open("rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return {}, _Run()
        if len(raw) > MAX_FILE_BYTES:
            raise PipelineError(f"{self.path}: larger than {MAX_FILE_BYTES} bytes; not a batch-marks file")
        try:
            document = json.loads(raw)
            if not isinstance(document, dict):
                raise ValueError("not a JSON object")
            version = document.get("format")
            if version == FORMAT:
                runs = document["runs"]
                if not isinstance(runs, list):
                    raise ValueError("'runs' is not a list")
                loaded: dict[str, _Run] = {}
                for entry in runs:
                    run_id, floor, marks = entry
                    if not (isinstance(run_id, str) and 1 <= len(run_id) <= MAX_RUN_ID) or run_id in loaded:
                        raise ValueError(f"run id {run_id!r} is not a run id, or is named twice")
                    loaded[run_id] = _Run(_floor_of(floor), _marks_of(marks, steps=True))
                legacy = document["legacy"]
                if not isinstance(legacy, dict):
                    raise ValueError("'legacy' is not an object")
                return loaded, _Run(_floor_of(legacy["floor"]), _marks_of(legacy["next"], steps=None))
            if version not in (FORMAT_V2, FORMAT_V1):
                raise ValueError(f"format is {version!r}, not {FORMAT!r}")
            floor = document.get("floor", 0) if version == FORMAT_V2 else 0
            return {}, _Run(_floor_of(floor), _marks_of(document["next"], steps=version == FORMAT_V2))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise PipelineError(
                f"{self.path}: unreadable batch marks ({exc}); move it aside only if this node never signed "
                "a batch of the groups it names (it would sign their batch numbers again)"
            ) from None

    def _save(self) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        document = {
            "format": FORMAT,
            "runs": [[r, run.floor, _rows(run.marks)] for r, run in self._runs.items()],
            "legacy": {"floor": self.legacy.floor, "next": _rows(self.legacy.marks)},
        }
        tmp.write_text(json.dumps(document))
        fsync_path(tmp)
        os.replace(tmp, self.path)
        fsync_path(self.path.parent)


def _rows(marks: dict[str, _Mark]) -> list[list[object]]:
    return [[g, m.step, m.next] for g, m in marks.items()]


def _floor_of(value: object) -> int:
    if not _natural(value):
        raise ValueError(f"floor {value!r} is not a step number")
    assert isinstance(value, int)
    return value


def _marks_of(entries: object, *, steps: bool | None) -> dict[str, _Mark]:
    """Marks of [group id, step, next] entries (`steps` False: v1's [group id, next]; None: a step or null)."""
    if not isinstance(entries, list):
        raise ValueError("'next' is not a list")
    loaded: dict[str, _Mark] = {}
    for entry in entries:
        if steps is False:
            group_id, batch = entry
            step = None
        else:
            group_id, step, batch = entry
        if steps is True and step is None:
            raise ValueError(f"entry {entry!r} names no step")
        if not (isinstance(group_id, str) and _natural(batch) and (step is None or _natural(step))):
            raise ValueError(
                f"entry {entry!r} is not a group id, a step and a batch number (both integers >= 0)"
            )
        loaded[group_id] = _Mark(step, batch)
    return loaded


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
