"""Errors of the swarm layer; all derive from the p2p package's one base, P2PError."""

from __future__ import annotations

from ..errors import P2PError


class SwarmError(P2PError):
    """The swarm could not be joined or used (DHT process, bootstrap, configuration)."""


class RecordError(SwarmError):
    """A DHT record is malformed, oversized, expired too far ahead, or not signed by whom it must be."""


class HandoffError(SwarmError):
    """A rollout hand-off failed in transport (timeout, connection, protocol violation)."""


class HandoffRefused(HandoffError):
    """The receiving validator refused a rollout file; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the validator refused the rollout file: {reason}")
        self.reason = reason


class HandoffBusy(HandoffError):
    """The validator cannot take the file now (rate limit, full queue): not a verdict; send it again later.

    A transport-class error on purpose: senders that retry HandoffError with backoff keep the file.
    """

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(f"the validator is busy: {reason}")
        self.reason = reason
        self.retry_after_s = retry_after_s  # the validator's hint; 0 when it gave none


class HandoffTooSlow(HandoffError):
    """The sender's body arrived below the receiver's rate floor or past its deadline: the stream was cut."""
