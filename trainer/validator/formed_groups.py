"""The groups the operator's coordinator formed, as the validator knows them: operator-signed group records.

A stage file names its group's members, and the group id is their digest, so anyone can make up a group of its
own identities and run real, signed work in it. The validator accepts a group's work only when an operator-signed
group record (trainer/groups/coordinator.py publishes them, p2p/swarm/group_records.py) forms exactly that group:
the same members in stage order, policy step and boundaries. The records are read from the DHT through the
validator's swarm, whose reader opens only records signed by a pinned operator key (the keys it pins for bans and
policies, `swarm.operator_keys`; p2p/swarm/directory.py), as every node reads them (node/pipeline/membership.py).

Timing: a group's files arrive after its batch, when a newer round may have dissolved the group and the record is
no longer re-signed (it stays in the DHT until its TTL runs out). The group id includes the policy step, so a
record of that id was the group's record for the batch's step whatever happened since; the validator keeps every
record it has read for `keep_s` after it last saw it (at most `MAX_RECORDS`, oldest sighting out), and a file
whose group it does not know is judged against a DHT read that started after the file arrived (at most one read
per `refresh_s`), so a record published just before the batch ran is found.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from ...p2p.pipeline.layout import StageLayout
from ...p2p.swarm.group_records import GroupRecord, group_id

MAX_RECORDS = (
    16384  # records kept: a few hundred groups a round, a few rounds a policy step; only the operator signs
)


@dataclass(frozen=True)
class FormedSettings:
    keep_s: float  # how long a record is kept after the validator last read it
    refresh_s: float  # the least time between two DHT reads


def why_not_formed(
    record: GroupRecord | None, members: Sequence[str], policy_step: int, layout: StageLayout
) -> str | None:
    """None when `record` forms the group a file names; else a one-line reason."""
    if record is None:
        return "no operator-signed group record forms this group (the coordinator did not form it)"
    if list(record.members) != list(members):
        return "the operator-signed group record names other members, or another stage order"
    if record.policy_step != policy_step:
        return f"the operator-signed group record is for policy step {record.policy_step}, not {policy_step}"
    if record.layout != layout:
        return f"the operator-signed group record cuts at {record.layout.boundaries}, the run at {layout.boundaries}"
    return None


class FormedGroups:
    """Operator-signed group records by group id, each kept `keep_s` after it was last read. The event loop's."""

    def __init__(
        self,
        read: Callable[[], Awaitable[Mapping[str, GroupRecord]]],
        run_id: str,
        settings: FormedSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.read, self.run_id, self.settings, self.clock = read, run_id, settings, clock
        self._records: collections.OrderedDict[str, tuple[GroupRecord, float]] = collections.OrderedDict()
        self.read_started = float("-inf")  # when the last successful read began
        self.last_try = float("-inf")  # when the last read (successful or not) began

    def __len__(self) -> int:
        return len(self._records)

    def find(self, group: str) -> GroupRecord | None:
        found = self._records.get(group)
        if found is None or self.clock() - found[1] > self.settings.keep_s:
            return None
        return found[0]

    def read_since(self, since: float) -> bool:
        """Whether a successful read began at or after `since` (a file's arrival): its answer is then final."""
        return self.read_started >= since

    def may_read(self) -> bool:
        return self.clock() - self.last_try >= self.settings.refresh_s

    async def refresh(self) -> None:
        """Read every live group record from the DHT; a failed read raises (OSError, EOFError, P2PError)."""
        started = self.last_try = self.clock()
        records = await self.read()
        for gid, record in records.items():
            # The DHT checked the operator's signature and the schema; the id must also be the digest the
            # group's files carry, or the record forms no group a file can name.
            if gid != record.group_id or gid != group_id(self.run_id, record.policy_step, record.members):
                continue
            known = self._records.pop(gid, None)
            if known is None or known[0].round <= record.round:
                known = (record, started)
            self._records[gid] = (known[0], started)  # newest sighting last
        self.read_started = started
        while self._records:
            oldest, (_, seen) = next(iter(self._records.items()))
            if len(self._records) <= MAX_RECORDS and started - seen <= self.settings.keep_s:
                break
            del self._records[oldest]
