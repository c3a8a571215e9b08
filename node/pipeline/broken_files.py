"""How many files this node writes about broken batches: at most so many per group and per neighbour in a window.

Every member of a group writes a file for the validator about each batch that began and broke (its partial
record, or a fraud report against its predecessor; node/contributor/pipeline_stage.py). A neighbour that opens a
batch's stream and hangs up, again and again, breaks a batch every `pipeline.retry_s` (0.5 s): unbounded, that
was a file per member and retry, filling the outbox, the disk and the validator's queue. `BrokenFileBudget`
admits a partial record only while the group has had fewer than `per_group`, and each peer charged with it
fewer than `per_peer`, admitted within the last `window_s`; a refused file is counted against nobody. The peer
charged is the neighbour whose stream broke when the host knows it (host.py `BatchLost.broken_by`), else both
neighbours: an honest neighbour is not charged for a batch the other one broke.

Fraud reports have a quota of their own (`fraud_per_group`, `fraud_per_peer`, charged to the predecessor they
name): they are the evidence that bans a peer, so a peer that first hangs up a few times must not spend the
budget that would report its bad frames next. Only a peer that sends a frame its commitment belies can spend
it, and one report is enough to ban it, so the quota is small.

The first broken batches of a group are the ones kept. They are mostly the same batches at every honest member,
so the validator gets every member's record of those (what `blame_broken` needs to name a culprit), but not
always: a member whose outbox is full, or whose limit for a peer was spent in another group, withholds a batch
another member writes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Withheld:
    reason: str  # the limit reached: "group_limit" or "peer_limit" (a metric label)
    why: str


class BrokenFileBudget:
    def __init__(
        self,
        per_group: int,
        per_peer: int,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        fraud_per_group: int = 2,
        fraud_per_peer: int = 2,
    ) -> None:
        if min(per_group, per_peer, fraud_per_group, fraud_per_peer) < 1 or not window_s > 0:
            raise ValueError(
                f"broken-file limits must be positive: per_group {per_group}, per_peer {per_peer}, "
                f"fraud_per_group {fraud_per_group}, fraud_per_peer {fraud_per_peer}, window_s {window_s}"
            )
        self.window_s, self.clock = window_s, clock
        self.limits = {"partial": (per_group, per_peer), "fraud": (fraud_per_group, fraud_per_peer)}
        # Kind -> (group -> times, peer -> times) of its admitted files within the window, oldest first; at most
        # the key's limit each, and a key is dropped once its window is empty, so this holds only the window's.
        self._admitted: dict[str, tuple[dict[str, deque[float]], dict[str, deque[float]]]] = {
            kind: ({}, {}) for kind in self.limits
        }

    def admit(self, group_id: str, peers: Iterable[str], *, fraud: bool = False) -> Withheld | None:
        """None, and the file counted against `group_id` and each of `peers` (within the fraud reports' quota
        with `fraud`, else the partial records'), when it may be written; else why not (the limit reached)."""
        kind = "fraud" if fraud else "partial"
        per_group, per_peer = self.limits[kind]
        groups, peer_times = self._admitted[kind]
        what = "fraud reports" if fraud else "files about broken batches"
        now = self.clock()
        for times in (groups, peer_times):
            _expire(times, now - self.window_s)
        if len(groups.get(group_id, ())) >= per_group:
            return Withheld(
                "group_limit", f"{per_group} {what} of this group in {self.window_s:.0f} s already"
            )
        suspects = sorted(set(peers))
        for peer in suspects:
            if len(peer_times.get(peer, ())) >= per_peer:
                return Withheld(
                    "peer_limit",
                    f"{per_peer} {what} with peer {peer[:16]}… as a neighbour in {self.window_s:.0f} s already",
                )
        groups.setdefault(group_id, deque()).append(now)
        for peer in suspects:
            peer_times.setdefault(peer, deque()).append(now)
        return None


def _expire(times: dict[str, deque[float]], before: float) -> None:
    for key in list(times):
        found = times[key]
        while found and found[0] <= before:
            found.popleft()
        if not found:
            del times[key]
