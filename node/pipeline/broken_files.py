"""How many files this node writes about broken batches: at most so many per group and per neighbour in a window.

Every member of a group writes a file for the validator about each batch that began and broke (its partial
record, or a fraud report against its predecessor; node/contributor/pipeline_stage.py). A neighbour that opens a
batch's stream and hangs up, again and again, breaks a batch every `pipeline.retry_s` (0.5 s): unbounded, that
was a file per member and retry, filling the outbox, the disk and the validator's queue. `BrokenFileBudget`
admits a file only while the group has had fewer than `per_group`, and each peer that could have broken it
(the neighbours whose streams this stage read or wrote) fewer than `per_peer`, admitted within the last
`window_s`; a refused file is counted against nobody. The first broken batches of a group are the ones kept,
and they are the same batches at every honest member, so the validator still gets every member's record of
those (what `blame_broken` needs to name a culprit).
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
    ) -> None:
        if per_group < 1 or per_peer < 1 or not window_s > 0:
            raise ValueError(
                f"broken-file limits must be positive: per_group {per_group}, per_peer {per_peer}, "
                f"window_s {window_s}"
            )
        self.per_group, self.per_peer, self.window_s, self.clock = per_group, per_peer, window_s, clock
        # Key -> the times of its admitted files within the window, oldest first; at most the key's limit each,
        # and a key is dropped once its window is empty, so this holds only the window's admitted files.
        self._groups: dict[str, deque[float]] = {}
        self._peers: dict[str, deque[float]] = {}

    def admit(self, group_id: str, peers: Iterable[str]) -> Withheld | None:
        """None, and the file counted against `group_id` and each of `peers`, when it may be written; else
        why not (the limit it would exceed)."""
        now = self.clock()
        for times in (self._groups, self._peers):
            _expire(times, now - self.window_s)
        if len(self._groups.get(group_id, ())) >= self.per_group:
            return Withheld(
                "group_limit",
                f"{self.per_group} files about broken batches of this group in {self.window_s:.0f} s already",
            )
        suspects = sorted(set(peers))
        for peer in suspects:
            if len(self._peers.get(peer, ())) >= self.per_peer:
                return Withheld(
                    "peer_limit",
                    f"{self.per_peer} files about broken batches with peer {peer[:16]}… as a neighbour in "
                    f"{self.window_s:.0f} s already",
                )
        self._groups.setdefault(group_id, deque()).append(now)
        for peer in suspects:
            self._peers.setdefault(peer, deque()).append(now)
        return None


def _expire(times: dict[str, deque[float]], before: float) -> None:
    for key in list(times):
        found = times[key]
        while found and found[0] <= before:
            found.popleft()
        if not found:
            del times[key]
