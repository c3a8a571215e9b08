"""Per group, the lowest batch number this node has not yet signed an opening for: batch numbers never repeat.

A stage signs a stream opening per batch (group, step, batch, stage). Were a stage task to start again at batch
0 after a restart of the node, or after it left its group and rejoined the same group (the group id is the
digest of run, step and members, so a group re-formed from the same members is the same group), it would sign
other frames under an opening it had signed before: two validly signed streams of one opening that diverge,
which a neighbour holding both could present as this member's equivocation. So the number is recorded, durably,
before the opening is signed (`use`), and a stage task starts from `next_batch`.

The marks live in one small JSON file in the node's state directory (replaced atomically and fsynced: a crash
leaves the old file or the new one, never a torn one), at most `keep` groups, the least recently used dropped
first (a group of an old policy step never comes back: the step is part of its id). A file that cannot be read
is an error naming it, not a silent reset to batch 0, which would defeat the point. With no path the marks live
in memory only (tests; a process that never restarts still never repeats a number across rejoins).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from ..runtime.durable import fsync_path
from .errors import PipelineError

FORMAT = "prime-node/pipeline-batch-marks/v1"
KEEP_GROUPS = 1024
MAX_FILE_BYTES = 1 << 20


class BatchMarks:
    def __init__(self, path: Path | None, *, keep: int = KEEP_GROUPS) -> None:
        self.path, self.keep = path, keep
        self._lock = threading.Lock()  # `use` runs in worker threads
        self._next: dict[str, int] = self._load() if path is not None else {}

    def next_batch(self, group_id: str) -> int:
        """The first batch number of `group_id` this node has not signed an opening for."""
        with self._lock:
            return self._next.get(group_id, 0)

    def use(self, group_id: str, batch: int) -> None:
        """Record that batch `batch` of `group_id` is about to be signed; on disk before this returns."""
        with self._lock:
            if batch < self._next.get(group_id, 0):
                raise PipelineError(
                    f"batch {batch} of group {group_id[:16]}… was already used (next free: {self._next[group_id]})"
                )
            self._next.pop(group_id, None)  # re-inserted last: dicts keep insertion order, oldest first
            self._next[group_id] = batch + 1
            while len(self._next) > self.keep:
                del self._next[next(iter(self._next))]
            if self.path is not None:
                self._save()

    def _load(self) -> dict[str, int]:
        assert self.path is not None
        try:
            with self.path.open("rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return {}
        if len(raw) > MAX_FILE_BYTES:
            raise PipelineError(f"{self.path}: larger than {MAX_FILE_BYTES} bytes; not a batch-marks file")
        try:
            document = json.loads(raw)
            if document.get("format") != FORMAT:
                raise ValueError(f"format is {document.get('format')!r}, not {FORMAT!r}")
            marks = document["next"]
            if not isinstance(marks, list):
                raise ValueError("'next' is not a list")
            loaded: dict[str, int] = {}
            for group_id, batch in marks:
                if not (isinstance(group_id, str) and isinstance(batch, int) and batch >= 0):
                    raise ValueError(f"entry {group_id!r}: {batch!r} is not a group id and a batch number")
                loaded[group_id] = batch
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise PipelineError(
                f"{self.path}: unreadable batch marks ({exc}); move it aside only if this node never signed "
                "a batch of the groups it names (it would sign their batch numbers again)"
            ) from None
        return loaded

    def _save(self) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        document = {"format": FORMAT, "next": [[g, b] for g, b in self._next.items()]}
        tmp.write_text(json.dumps(document))
        fsync_path(tmp)
        os.replace(tmp, self.path)
        fsync_path(self.path.parent)
