"""Stage files waiting for the rest of their group: the grace period, and when a group is judged.

A pipelined group's batch is judged as a whole (trainer/validator/group_job.py), so its members' stage files are
collected here by (group id, policy step, batch), the key their v3 envelopes sign, instead of joining the
validator's file queue. A file first *arrives* (`arrive`): it joins its group only once the service found that
it parses, that its signer is a member of the group it names and that an operator-signed record formed that
group (service.py `_arrival`), so that junk routed to a group's key cannot start the group's grace period.
A group is judged as soon as it has a file per stage, and in any case once `group_grace_s` has passed since its
first admitted file arrived: then a stage still missing makes the group incomplete (docs/pipeline.md,
"Verdicts"). A file that arrived within that grace period but is still being checked (`unsettled`) keeps the
group open until the check ends (the service's checks take milliseconds, or a file's own grace period while its
group's record is looked for), so that the time the validator spends is never counted against the members.
A group whose checkpoint the validator does not hold waits like a rollout file does, up to `hold_timeout_s`
from its first file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")


class GroupKey(NamedTuple):
    group: str  # the group id its envelopes sign
    policy_step: int
    batch: int


@dataclass
class PendingGroup(Generic[T]):
    key: GroupKey
    first_at: float  # when its first file was accepted (time.time())
    jobs: list[T] = field(default_factory=list)
    tried_with: int = 0  # files it held when it was last judged early (an incomplete try waits for more)
    holding: bool = False  # its checkpoint is not held: retried on every tick until the hold timeout
    urgent: bool = (
        False  # it holds fraud evidence: judged at once (the batch was abandoned, no files will come)
    )


class GroupIntake(Generic[T]):
    """Pending groups; `due` says which to judge now. Not thread-safe: the event loop's."""

    def __init__(self, stages: int, grace_s: float, hold_timeout_s: float, max_groups: int) -> None:
        self.stages, self.grace_s, self.hold_timeout_s, self.max_groups = (
            stages,
            grace_s,
            hold_timeout_s,
            max_groups,
        )
        self.pending: dict[GroupKey, PendingGroup[T]] = {}
        # Files not yet checked: they start no timer and count towards no group (the admission's queue bounds
        # bound them, as every file the validator holds).
        self.arrivals: list[T] = []
        # Arrival times of the files of each key that arrived but were neither added nor decided yet.
        self.unsettled: dict[GroupKey, list[float]] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def full(self, key: GroupKey) -> bool:
        """Whether a file of a new group must wait (busy): a bound on groups pending, whatever senders claim."""
        return key not in self.pending and len(self.pending) >= self.max_groups

    def arrive(self, key: GroupKey, job: T, at: float) -> None:
        """A new file of `key`, received at `at`: to be checked (`take_arrivals`), then `settle`d."""
        self.arrivals.append(job)
        self.unsettled.setdefault(key, []).append(at)

    def settle(self, key: GroupKey, at: float) -> None:
        """The file of `key` received at `at` was added to its group or decided."""
        times = self.unsettled.get(key)
        if times is not None and at in times:
            times.remove(at)
            if not times:
                del self.unsettled[key]

    def retry(self, job: T) -> None:
        """An arrival still unsettled (its group's record not known yet): checked again on a later pass."""
        self.arrivals.append(job)

    def take_arrivals(self) -> list[T]:
        taken, self.arrivals = self.arrivals, []
        return taken

    def add(self, key: GroupKey, job: T, now: float, *, urgent: bool = False) -> None:
        group = self.pending.setdefault(key, PendingGroup(key, now))
        group.jobs.append(job)
        group.urgent = group.urgent or urgent

    def due(self, now: float) -> list[tuple[PendingGroup[T], bool]]:
        """(group, complete) for every group to judge now: complete when its grace period is over."""
        found = []
        for group in self.pending.values():
            end = group.first_at + self.grace_s
            over = now >= end and not any(at <= end for at in self.unsettled.get(group.key, ()))
            fresh = len(group.jobs) > group.tried_with
            if group.holding or over or (fresh and (group.urgent or len(group.jobs) >= self.stages)):
                found.append((group, over))
        return found

    def hold_expired(self, group: PendingGroup[T], now: float) -> bool:
        return now >= group.first_at + self.hold_timeout_s

    def done(self, key: GroupKey) -> None:
        self.pending.pop(key, None)
