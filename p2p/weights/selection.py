"""Which shards of a signed manifest a fetch is to hold: the whole checkpoint, or a selection of it.

A pipeline stage needs only its own layers' bytes (docs/pipeline.md, "Selective download"), so a fetch may be
given a plan (`SelectionPlan`) instead of fetching every shard. The plan is asked, in rounds, which shards the
version must hold given the shards already verified on disk: a stage's plan first asks for the small files and
the first shard of each safetensors file, then (reading the header length from those verified bytes) for the
header's shards, then (parsing the header) for its tensors' shards. Each round's answer is fetched and verified
exactly as a whole fetch's shards are (every shard's SHA-256 against the signed manifest, whoever sent it), and
the plan reads nothing but verified bytes. The rounds stop once an answer is already held; a plan that keeps
growing past MAX_PLAN_ROUNDS is a bug, reported as such.

A version held in part stays under the store's .partial/ directory (store.py): nothing that lists complete
versions sees it, a monolithic load is refused naming the shards it lacks (`Store.whole_checkpoint_dir`), and
its server advertises and serves only the shards it holds (serve_verified.py). Asked later for more (another
stage, or the whole), the fetch resumes from it and downloads only the missing shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .errors import FetchError
from .manifest import SignedManifest

MAX_PLAN_ROUNDS = 4  # small files + first shards, headers, tensors: three in practice, one spare
MAX_LISTED = 8  # shard ranges named in a message before the rest are counted


@dataclass(frozen=True)
class Selection:
    """A set of shard indices of one manifest, each checked to be one of its shards."""

    shards: frozenset[int]
    count: int  # shards in the manifest

    @classmethod
    def of(cls, manifest: SignedManifest, shards: Iterable[int]) -> Selection:
        count = len(manifest.body.shards)
        chosen = frozenset(shards)
        bad = sorted(i for i in chosen if not 0 <= i < count)
        if bad:
            raise FetchError(f"a selection names shards {describe_shards(bad)}; the manifest has {count}")
        return cls(chosen, count)

    @classmethod
    def whole(cls, manifest: SignedManifest) -> Selection:
        count = len(manifest.body.shards)
        return cls(frozenset(range(count)), count)

    @property
    def is_whole(self) -> bool:
        return len(self.shards) == self.count

    def size(self, manifest: SignedManifest) -> int:
        """Bytes of the selected shards."""
        shards = manifest.body.shards
        return sum(shards[i].size for i in self.shards)

    def __or__(self, other: Selection) -> Selection:
        return Selection(self.shards | other.shards, self.count)


class SelectionPlan(Protocol):
    """Says which shards a version must hold. Blocking (it may read the version's verified files); called on a
    worker thread, once per round, with the shards verified so far. PlanError when the checkpoint does not fit
    the plan."""

    def choose(self, manifest: SignedManifest, checkpoint_dir: Path, held: frozenset[int]) -> Selection: ...


def describe_shards(indices: Iterable[int]) -> str:
    """Shard indices as ranges for a message: '0-3, 7, 9-12 (and 5 more ranges)'."""
    ordered = sorted(set(indices))
    runs: list[tuple[int, int]] = []
    for index in ordered:
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:MAX_LISTED]]
    if len(runs) > MAX_LISTED:
        parts.append(f"(and {len(runs) - MAX_LISTED} more ranges)")
    return ", ".join(parts) or "none"
