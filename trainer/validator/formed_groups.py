"""The groups the operator's coordinator formed, as the validator knows them: operator-signed group records.

A stage file names its group's members, and the group id is their digest, so anyone can make up a group of its
own identities and run real, signed work in it. The validator accepts a group's work only when an operator-signed
group record (trainer/groups/coordinator.py publishes them, p2p/swarm/group_records.py) forms exactly that group:
the same members in stage order, policy step and layout (boundaries, and the batch shape the run pins). The
records are read from the DHT through the validator's swarm, whose reader opens only records signed by a pinned
operator key (the keys it pins for bans and policies, `swarm.operator_keys`; p2p/swarm/directory.py), as every
node reads them (node/pipeline/membership.py).

Timing: a group's files arrive after its batch, when a newer round may have dissolved the group and the record is
no longer re-signed (it leaves the DHT when its TTL runs out). The group id includes the policy step, so a record
of that id was the group's record for the batch's step whatever happened since; the validator keeps every record
it has read for `keep_s` after it last saw it (at most `MAX_RECORDS`, oldest sighting out). A DHT read that does
not show a record proves little (a lookup may miss the peers that hold it, and reports that as finding nothing),
so the service re-reads (at most one read per `refresh_s`, in its own task) until the file's grace period ends.

The records survive a restart: each is kept on disk with the signed value it came in (`path`, at most
`MAX_RECORDS`), and every one is opened again on load with the same checks, its operator signature included, so
a file spooled before the restart still finds a record that has since left the DHT.
"""

from __future__ import annotations

import base64
import binascii
import collections
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...p2p.pipeline.layout import StageLayout, layout_differences
from ...p2p.swarm.directory import SealedRecord
from ...p2p.swarm.errors import RecordError
from ...p2p.swarm.group_records import GroupRecord, group_id
from ...p2p.swarm.kinds import RecordKind
from ...p2p.swarm.records import reopen_record

logger = logging.getLogger(__name__)

MAX_RECORDS = (
    16384  # records kept: a few hundred groups a round, a few rounds a policy step; only the operator signs
)
MAX_FILE_BYTES = (
    64 << 20
)  # the kept records on disk: MAX_RECORDS signed values of at most a few KiB, base64'd
FILE_VERSION = 1

# What the DHT answered: the signed records by subkey, or None when the lookup found no table at all.
GroupRead = Callable[[], Awaitable[Mapping[str, SealedRecord] | None]]


@dataclass(frozen=True)
class FormedSettings:
    keep_s: float  # how long a record is kept after the validator last read it
    refresh_s: float  # the least time between two DHT reads


@dataclass(frozen=True)
class _Known:
    record: GroupRecord
    sealed: SealedRecord
    seen: float  # when a read that showed it began


def why_not_formed(
    record: GroupRecord | None, members: Sequence[str], policy_step: int, layout: StageLayout
) -> str | None:
    """None when `record` forms the group a file names; else a one-line reason.

    Only the absent record and the layout can differ in practice: a record is kept under its group id only when
    the id is the digest of its run, policy step, members, layout and nonce (`FormedGroups.refresh`), and the
    file's readers check that the id its envelope signs is the digest of the members, step, layout digest and
    nonce the file names, so the member and step checks are defence in depth, should either of those checks ever
    change. (A file made under a layout the run has since left names that layout's record, which differs from the
    run's: excused.)"""
    if record is None:
        return "no operator-signed group record forms this group (the coordinator did not form it)"
    if list(record.members) != list(members):
        return "the operator-signed group record names other members, or another stage order"
    if record.policy_step != policy_step:
        return f"the operator-signed group record is for policy step {record.policy_step}, not {policy_step}"
    if record.layout != layout:
        found = "; ".join(
            f"{name} {theirs!r}, the run's {ours!r}"
            for name, ours, theirs in layout_differences(layout, record.layout)
        )
        return f"the operator-signed group record's layout is not the run's ({found})"
    return None


class FormedGroups:
    """Operator-signed group records by group id, each kept `keep_s` after it was last read. The event loop's.

    `path`: where the records are kept across restarts (None: in memory only). `operator_keys`: the keys a record
    read back from disk must be signed by (the swarm's pinned operator keys)."""

    def __init__(
        self,
        read: GroupRead,
        run_id: str,
        settings: FormedSettings,
        *,
        operator_keys: frozenset[str] = frozenset(),
        path: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.read, self.run_id, self.settings, self.clock = read, run_id, settings, clock
        self.operator_keys, self.path = operator_keys, path
        self._records: collections.OrderedDict[str, _Known] = collections.OrderedDict()
        self.answered_at = float("-inf")  # when the last read that found a table of records began
        self.last_try = float("-inf")  # when the last read (whatever its answer) began
        self._saved_at = float("-inf")

    def __len__(self) -> int:
        return len(self._records)

    def find(self, group: str) -> GroupRecord | None:
        found = self._records.get(group)
        if found is None or self.clock() - found.seen > self.settings.keep_s:
            return None
        return found.record

    def answered_since(self, since: float) -> bool:
        """Whether a read that found the DHT's table of records began at or after `since` (a file's arrival)."""
        return self.answered_at >= since

    def may_read(self) -> bool:
        return self.clock() - self.last_try >= self.settings.refresh_s

    async def refresh(self) -> bool:
        """Read every live group record from the DHT; True when something new was learned (the caller saves).

        A failed read raises (OSError, EOFError, P2PError); a lookup that found no table counts as tried, not
        answered."""
        started = self.last_try = self.clock()
        records = await self.read()
        if records is None:
            return False
        learned = self._learn(records.items(), started)
        self.answered_at = started
        self._trim(started)
        return learned

    def _learn(self, records: Iterable[tuple[str, SealedRecord]], seen: float) -> bool:
        learned = False
        for gid, sealed in records:
            record = sealed.body
            # The DHT checked the operator's signature and the schema; the id must also be the digest the
            # group's files carry, or the record forms no group a file can name.
            if not isinstance(record, GroupRecord) or gid != record.group_id:
                continue
            if gid != group_id(self.run_id, record.policy_step, record.members, record.layout, record.nonce):
                continue
            known = self._records.pop(gid, None)
            if known is None or known.record.round < record.round:
                learned = True
                known = _Known(record, sealed, seen)
            self._records[gid] = _Known(
                known.record, known.sealed, max(seen, known.seen)
            )  # newest sighting last
        return learned

    def _trim(self, now: float) -> None:
        while self._records:
            oldest, known = next(iter(self._records.items()))
            if len(self._records) <= MAX_RECORDS and now - known.seen <= self.settings.keep_s:
                break
            del self._records[oldest]

    # ----- kept across restarts ----------------------------------------------------------------------------

    def should_save(self, learned: bool) -> bool:
        """Save after learning a record, and often enough that the sightings on disk are at most a fraction of
        `keep_s` old (a record is kept `keep_s` from the sighting the file holds)."""
        if self.path is None or not self._records:
            return False
        return learned or self.clock() - self._saved_at >= self.settings.keep_s / 8

    def snapshot(self) -> list[dict[str, object]]:
        """The kept records as the file holds them (taken on the event loop; written by `write`, off it)."""
        self._saved_at = self.clock()
        return [
            {
                "group_id": gid,
                "value": base64.b64encode(k.sealed.value).decode(),
                "expiration": k.sealed.expiration,
                "seen": k.seen,
            }
            for gid, k in self._records.items()
        ]

    def write(self, rows: list[dict[str, object]]) -> None:
        """Replace the file atomically (a crash leaves the old one or the new one). Blocking."""
        assert self.path is not None
        data = json.dumps({"version": FILE_VERSION, "records": rows}).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def load(self) -> int:
        """Read the kept records back, each opened again as the DHT's reader opens it (schema, operator signature,
        group id); a record that fails is dropped with a warning, an unreadable file is ignored. Blocking."""
        if self.path is None or not self.path.exists():
            return 0
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
            if len(data) > MAX_FILE_BYTES:
                raise ValueError(f"it is over {MAX_FILE_BYTES} bytes")
            document = json.loads(data)
            if not isinstance(document, dict) or document.get("version") != FILE_VERSION:
                raise ValueError(f"it is not a version {FILE_VERSION} table of group records")
            rows = document.get("records")
            if not isinstance(rows, list):
                raise ValueError("it has no list of records")
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the kept group records in %s: %s", self.path, exc)
            return 0
        now = self.clock()
        for row in rows[-MAX_RECORDS:]:
            try:
                gid, seen, sealed = self._reopen(row, now)
            except (RecordError, ValueError, TypeError, KeyError, binascii.Error) as exc:
                logger.warning("dropping a kept group record that no longer opens: %s", exc)
                continue
            self._learn([(gid, sealed)], seen)
        self._trim(now)
        return len(self._records)

    def _reopen(self, row: object, now: float) -> tuple[str, float, SealedRecord]:
        if not isinstance(row, dict):
            raise ValueError("a kept record is not an object")
        gid, value, expiration, seen = row["group_id"], row["value"], row["expiration"], row["seen"]
        if not isinstance(gid, str) or not isinstance(value, str):
            raise ValueError("a kept record's group id or value is not a string")
        for number in (expiration, seen):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
                raise ValueError("a kept record's expiration or sighting is not a finite number")
        raw = base64.b64decode(value, validate=True)
        record = reopen_record(
            self.run_id, RecordKind.GROUP, gid, raw, float(expiration), self.operator_keys, now
        )
        # A sighting from the future (a clock set back, an edited file) would keep the record for ever.
        return gid, min(float(seen), now), SealedRecord(record, raw, float(expiration))
