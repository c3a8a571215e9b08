"""Errors of the weights sub-package; all derive from the p2p package's base, P2PError."""

from __future__ import annotations

from ..errors import P2PError


class WeightsError(P2PError):
    """Base class of errors raised by prime_node.p2p.weights."""


class ManifestError(WeightsError):
    """A manifest is oversized, malformed, unsigned, signed by the wrong key, or inconsistent."""


class ManifestAbsent(ManifestError):
    """A source does not hold the version (yet): it answered 404 or 503 for the manifest. A peer still fetching
    it may hold it soon, so the fetch asks it again (shardrun.py) rather than setting it aside for good."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = (
            status  # 404 (it does not serve that) or 503 (not now); decisions read this, not the text
        )


class SourceUnreachable(ManifestError):
    """No answer came: the connection was refused, reset or cut, or timed out, before the head of a response.
    Nothing the source said, so nothing it can be held to beyond being unreachable now (a restart looks so)."""


class ReplayError(ManifestError):
    """A manifest names a step older than one already held (a replayed or rolled-back checkpoint)."""


class StoreError(WeightsError):
    """The on-disk store is unusable: not enough free disk, unreadable state, or a conflicting version."""


class IncompleteVersion(StoreError):
    """A version is held only in part (a pipeline stage's shards, selection.py) and was asked for whole."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing  # the shard indices it lacks


class PlanError(WeightsError):
    """A selection plan (selection.py) cannot name the shards to hold: the verified checkpoint does not fit it
    (a layout for another model, a safetensors header out of bounds). The fetch of that version is refused."""


class PublishError(WeightsError):
    """A checkpoint directory cannot be published (missing, empty, or holding files that cannot be shipped)."""


class SourceError(WeightsError):
    """One source's answer broke the protocol (a malformed header, a wrong length, a missed deadline): a failure
    of that source alone, which the fetcher records against it before trying another; never the fetch's end."""

    def __init__(
        self,
        reason: str,
        *,
        corrupt: bool = False,
        retry_after: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        # The HTTP status of an answer that refused the request (404, 503, ...); None when the failure is not
        # a refusal (a broken body, a malformed head, a timeout). Decisions read this, never the reason text.
        self.status = status
        # The source sent wrong bytes or lied about them (penalised harder than sending nothing).
        self.corrupt = corrupt
        # Set when a relay answered 503: it has the version but has not verified this shard yet. That is not
        # the source's fault; the fetcher comes back after this many seconds without penalising it.
        self.retry_after = retry_after


class FetchError(WeightsError):
    """A checkpoint could not be fetched and verified; the message names the shard and the sources to blame."""

    def __init__(
        self, message: str, blame: list[dict[str, object]] | None = None, shard: int | None = None
    ) -> None:
        super().__init__(message)
        # Machine-readable record of what failed where: [{shard, source, reason, corrupt}, ...] (for --json).
        self.blame = blame or []
        self.shard = shard  # the shard that could not be fetched, when one is to blame
