"""Per group, the lowest batch number this node has not yet signed an opening for: batch numbers never repeat.

A stage signs a stream opening per batch (group, step, batch, stage). Were a stage task to start again at batch
0 after a restart of the node, or after it left its group and rejoined it, it would sign other frames under an
opening it had signed before: two validly signed streams of one opening that diverge, which a neighbour holding
both could present as this member's equivocation. So the number is recorded, durably, before the opening is
signed (`use`), and a stage task starts from `next_batch`.

**Which marks may be forgotten.** A group id is the digest of run, step, members, layout and the formation
nonce the coordinator drew when it formed the group (p2p/pipeline/group_ids.py): a group formed again from the
same members is another id, so a mark need outlive only the one formation it names. Two ways drop marks, each
raising a *floor* below which a group without a mark is refused for good (`why_refused`, `next_batch` and `use`
raise), so that no id whose mark was dropped is ever numbered from 0 again:

- By step. Each mark is kept with its group's policy step; the file keeps every mark of the newest `KEEP_STEPS`
  steps this node has used, and when a newer step pushes a step below `newest - KEEP_STEPS` that step's marks go
  and the run's step floor rises to `newest - KEEP_STEPS`: a step that far back lies outside both windows that
  could still use it (`async_level` and a validator's kept checkpoints are each at most 64 steps).
- By formation, for room. Each mark also keeps its group's formation time (milliseconds, from the nonce, which
  the operator signed in the record and the id binds). When the file would hold more than `max_marks` entries,
  the marks of the oldest formations go first (never the group being used), and the run's *formation floor*
  rises past the newest formation dropped: a group of that run formed no later than that is refused. The
  coordinator forms groups with its own clock, so every new formation lies past the floor; a group formed
  earlier that this node never ran is refused with it, which costs nothing once thousands of newer groups were
  formed. (Before the nonce, a frozen run, whose step never advances, kept every group's mark for good, since
  any could be formed again; once the file held 8192 it refused every new group, for good.)

The floors are the state that makes forgetting sound, so they are never dropped. A trainer whose clock is set
back below a node's formation floor has its new groups refused by that node until its clock passes the floor
(the reason names the floor).

**Per run.** Marks and floors are kept per run id: a node that reached step 500 in one run and then joins another
run with the same data directory starts that run with its own floors (0), not the first run's 372 (a group id
names its run, so the runs' marks never meet). A v1 or v2 file (written before marks were kept per run) is read
with its marks and floor of an unknown run: its marks are kept under their group ids for whichever run uses them
and its floor keeps applying to every run, never raised, since nothing says which run it came from.

**Older files.** Marks read from a v1-v3 file name ids computed without a nonce, which this version never
computes again (every group record carries a nonce, and the id's text then has one more field), so no group it
runs can be one of them: they are kept while there is room and are the first to go when there is none, without
raising a floor. Their step floors are kept.

The marks live in one small JSON file in the node's state directory (replaced atomically and fsynced: a crash
leaves the old file or the new one, never a torn one). A file that cannot be read is an error naming it, not a
silent reset to batch 0, which would defeat the point. With no path the marks live in memory only (tests; a
process that never restarts still never repeats a number across rejoins).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.durable import fsync_path
from .errors import PipelineError

FORMAT = "prime-node/pipeline-batch-marks/v4"
FORMAT_V3 = "prime-node/pipeline-batch-marks/v3"
FORMAT_V2 = "prime-node/pipeline-batch-marks/v2"
FORMAT_V1 = "prime-node/pipeline-batch-marks/v1"
# Twice the largest window that could still use a step (`async_level` and the validator's kept checkpoint
# versions are each at most 64): a step further back than this is never run again.
KEEP_STEPS = 128
MAX_FILE_BYTES = 1 << 20
# An entry is at most ~130 bytes of JSON (a 64-hex id, a step and a batch number below 2^63, a formation time in
# ms below 2^33 * 1000): 4096 fit in 1 MiB with room to spare. Runs count as entries too (a run id is at most 64
# characters, p2p/names.py; a file's at most MAX_RUN_ID, and two floors), so the bound holds for the file. Past
# it the oldest formations' marks are dropped (see the module's docstring): 4096 formations back, a group is
# never run again.
MAX_MARKS = 4096
MAX_RUN_ID = 128


@dataclass(frozen=True)
class _Mark:
    step: int | None  # None: read from a v1 file, which did not record it
    next: int
    formed: int | None  # its group's formation time (ms, from the nonce); None: read from a v1-v3 file


@dataclass
class _Run:
    floor: int = 0  # this run's groups of a step below this are refused: their marks may have been dropped
    marks: dict[str, _Mark] = field(default_factory=dict)
    # This run's groups formed before this (ms) are refused: marks of formations before it were dropped for room.
    formed_floor: int = 0


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

    def formed_floor(self, run_id: str) -> int:
        """The formation time (ms) before which groups of `run_id` that have no mark here are refused."""
        with self._lock:
            run = self._runs.get(run_id)
            return run.formed_floor if run is not None else 0

    def why_refused(self, run_id: str, group_id: str, step: int, *, formed_ms: int) -> str | None:
        """None when batches of `group_id` (a group of run `run_id` at policy step `step`, formed at `formed_ms`:
        its nonce's time) may be numbered here, else why not."""
        with self._lock:
            return self._refusal(run_id, group_id, step, formed_ms)

    def next_batch(self, run_id: str, group_id: str, step: int, *, formed_ms: int) -> int:
        """The first batch number of `group_id` (of run `run_id`) this node has not signed an opening for
        (PipelineError when the group is refused: its mark may have been dropped)."""
        with self._lock:
            self._refuse(run_id, group_id, step, formed_ms)
            mark = self._mark(run_id, group_id)
            return 0 if mark is None else mark.next

    def use(self, run_id: str, group_id: str, step: int, batch: int, *, formed_ms: int) -> None:
        """Record that batch `batch` of `group_id` (of run `run_id`, policy step `step`, formed at `formed_ms`) is
        about to be signed; on disk before this returns. Drops the run's marks of steps more than `keep_steps`
        below its newest, and the oldest formations' marks while the file would hold more than `max_marks`
        entries, raising the floors that refuse those groups."""
        with self._lock:
            self._refuse(run_id, group_id, step, formed_ms)
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
            run.marks[group_id] = _Mark(step if mark is None else mark.step, batch + 1, formed_ms)
            newest = max((m.step for m in run.marks.values() if m.step is not None), default=0)
            if newest - self.keep_steps > run.floor:
                run.floor = newest - self.keep_steps
                run.marks = {g: m for g, m in run.marks.items() if m.step is None or m.step >= run.floor}
            self._make_room(keep=group_id)
            if self.path is not None:
                self._save()

    def _make_room(self, keep: str) -> None:
        """Drop marks, oldest formation first (those of older files before any), until the entries fit, raising
        the formation floor of each run that lost one past it. Never `keep`, the group being used."""
        excess = self._entries() - self.max_marks
        if excess <= 0:
            return
        holders = [(run, run.marks) for run in self._runs.values()] + [(None, self.legacy.marks)]
        candidates = sorted(
            (
                (-1 if mark.formed is None else mark.formed, group_id, run, marks)
                for run, marks in holders
                for group_id, mark in marks.items()
                if group_id != keep
            ),
            key=lambda c: (c[0], c[1]),
        )
        for formed, group_id, run, marks in candidates[:excess]:
            del marks[group_id]
            if run is not None and formed >= 0:  # a v1-v3 mark names an id never computed again: no floor
                run.formed_floor = max(run.formed_floor, formed + 1)

    def _floor(self, run_id: str) -> int:
        run = self._runs.get(run_id)
        return max(self.legacy.floor, run.floor if run is not None else 0)

    def _mark(self, run_id: str, group_id: str) -> _Mark | None:
        run = self._runs.get(run_id)
        found = run.marks.get(group_id) if run is not None else None
        return found if found is not None else self.legacy.marks.get(group_id)

    def _entries(self) -> int:
        return len(self._runs) + sum(len(r.marks) for r in self._runs.values()) + len(self.legacy.marks)

    def _refusal(self, run_id: str, group_id: str, step: int, formed_ms: int) -> str | None:
        if not 1 <= len(run_id) <= MAX_RUN_ID:
            return f"its run id is {len(run_id)} characters; 1..{MAX_RUN_ID} are kept"
        if not _natural(formed_ms):
            return f"its formation time {formed_ms!r} is not a number of milliseconds"
        floor = self._floor(run_id)
        if step < floor:
            return (
                f"its policy step {step} is below {floor}, the oldest step of run {run_id!r} whose batch numbers "
                f"this node still keeps (it keeps {self.keep_steps} steps below the newest it used)"
            )
        if self._mark(run_id, group_id) is not None:
            return None
        run = self._runs.get(run_id)
        if run is not None and formed_ms < run.formed_floor:
            return (
                f"it was formed at {formed_ms} ms, before {run.formed_floor} ms: this node dropped the batch "
                f"marks of run {run_id!r}'s groups formed before then to make room, so it runs none of them"
            )
        new = 1 if run is not None else 2  # the mark, and the run's entry if it has none yet
        marks = sum(len(r.marks) for r in self._runs.values()) + len(self.legacy.marks)
        if self._entries() + new > self.max_marks and marks < new:  # nothing to drop to make room
            return (
                f"this node keeps the floors of {len(self._runs)} runs already, at most {self.max_marks} "
                "entries, and holds no mark it could drop"
            )
        return None

    def _refuse(self, run_id: str, group_id: str, step: int, formed_ms: int) -> None:
        why = self._refusal(run_id, group_id, step, formed_ms)
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
            if version in (FORMAT, FORMAT_V3):
                runs = document["runs"]
                if not isinstance(runs, list):
                    raise ValueError("'runs' is not a list")
                loaded: dict[str, _Run] = {}
                for entry in runs:
                    if version == FORMAT:
                        run_id, floor, formed_floor, marks = entry
                    else:
                        (run_id, floor, marks), formed_floor = entry, 0
                    if not (isinstance(run_id, str) and 1 <= len(run_id) <= MAX_RUN_ID) or run_id in loaded:
                        raise ValueError(f"run id {run_id!r} is not a run id, or is named twice")
                    kept = _marks_of(marks, steps=True, formed=version == FORMAT)
                    loaded[run_id] = _Run(_floor_of(floor), kept, _floor_of(formed_floor))
                legacy = document["legacy"]
                if not isinstance(legacy, dict):
                    raise ValueError("'legacy' is not an object")
                kept = _marks_of(legacy["next"], steps=None, formed=version == FORMAT)
                return loaded, _Run(_floor_of(legacy["floor"]), kept)
            if version not in (FORMAT_V2, FORMAT_V1):
                raise ValueError(f"format is {version!r}, not {FORMAT!r}")
            floor = document.get("floor", 0) if version == FORMAT_V2 else 0
            return {}, _Run(
                _floor_of(floor), _marks_of(document["next"], steps=version == FORMAT_V2, formed=False)
            )
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
            "runs": [[r, run.floor, run.formed_floor, _rows(run.marks)] for r, run in self._runs.items()],
            "legacy": {"floor": self.legacy.floor, "next": _rows(self.legacy.marks)},
        }
        tmp.write_text(json.dumps(document))
        fsync_path(tmp)
        os.replace(tmp, self.path)
        fsync_path(self.path.parent)


def _rows(marks: dict[str, _Mark]) -> list[list[object]]:
    return [[g, m.step, m.next, m.formed] for g, m in marks.items()]


def _floor_of(value: object) -> int:
    if not _natural(value):
        raise ValueError(f"floor {value!r} is not a step number or a time")
    assert isinstance(value, int)
    return value


def _marks_of(entries: object, *, steps: bool | None, formed: bool) -> dict[str, _Mark]:
    """Marks of [group id, step, next] entries (`steps` False: v1's [group id, next]; None: a step or null), with
    a fourth entry, the formation time or null, when `formed` (v4)."""
    if not isinstance(entries, list):
        raise ValueError("'next' is not a list")
    loaded: dict[str, _Mark] = {}
    for entry in entries:
        formed_ms = None
        if steps is False:
            group_id, batch = entry
            step = None
        elif formed:
            group_id, step, batch, formed_ms = entry
        else:
            group_id, step, batch = entry
        if steps is True and step is None:
            raise ValueError(f"entry {entry!r} names no step")
        if not (isinstance(group_id, str) and _natural(batch) and (step is None or _natural(step))):
            raise ValueError(
                f"entry {entry!r} is not a group id, a step and a batch number (both integers >= 0)"
            )
        if formed_ms is not None and not _natural(formed_ms):
            raise ValueError(f"entry {entry!r} has a formation time that is not an integer >= 0")
        loaded[group_id] = _Mark(step, batch, formed_ms)
    return loaded


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
