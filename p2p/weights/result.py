"""What a fetch returns: where the verified version lies, and how the fetch went (for logs, --json, metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .manifest import SignedManifest
from .store import CHECKPOINT_NAME


@dataclass
class FetchResult:
    """Where a fetched (or already held) version lies, and how the fetch went."""

    manifest: SignedManifest
    version_dir: Path
    fetched_bytes: int = 0  # shard bytes this fetch added to the version (total - resumed on success)
    resumed_bytes: int = 0
    received_bytes: int = (
        0  # every body byte received, including discarded copies (hedges lost, corrupt shards)
    )
    hedges: int = 0  # shards also asked of a second source because the first was slow
    hedges_won: int = 0  # ... and that second copy verified first
    seconds: float = 0.0
    already_held: bool = False
    sources: list[dict[str, object]] = field(default_factory=list)
    # The verified shards of a version held only in part (a selective fetch, selection.py: `version_dir` is
    # then its directory under the store's .partial/); None for a complete version.
    held: frozenset[int] | None = None
    rounds: int = 1  # fetches of a growing selection (selection.py `SelectionPlan`) that made it

    @property
    def checkpoint_dir(self) -> Path:
        return self.version_dir / CHECKPOINT_NAME

    @property
    def complete(self) -> bool:
        return self.held is None

    @property
    def held_bytes(self) -> int:
        """Bytes of the checkpoint held here once the fetch is done (its total when complete)."""
        if self.held is None:
            return self.manifest.body.total_size
        shards = self.manifest.body.shards
        return sum(shards[i].size for i in self.held)

    def report(self) -> dict[str, object]:
        return {
            "step": self.manifest.step,
            "run_id": self.manifest.body.run_id,
            "manifest_sha256": self.manifest.digest,
            "checkpoint_sha256": self.manifest.body.checkpoint_sha256,
            "checkpoint_dir": str(self.checkpoint_dir),
            "total_bytes": self.manifest.body.total_size,
            "complete": self.complete,
            "held_shards": len(self.manifest.body.shards) if self.held is None else len(self.held),
            "shards": len(self.manifest.body.shards),
            "held_bytes": self.held_bytes,
            "fetched_bytes": self.fetched_bytes,
            "resumed_bytes": self.resumed_bytes,
            "received_bytes": self.received_bytes,
            "hedges": self.hedges,
            "hedges_won": self.hedges_won,
            "seconds": round(self.seconds, 3),
            "already_held": self.already_held,
            "sources": self.sources,
        }
