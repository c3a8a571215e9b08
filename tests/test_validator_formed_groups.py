"""The validator's book of operator-signed group records (trainer/validator/formed_groups.py): which group a
file may name, how long a record stays known after the DHT stops showing it, and its bound."""

from __future__ import annotations

import asyncio

import pytest

from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.swarm.group_records import GroupRecord, group_id
from prime_node.trainer.validator import formed_groups
from prime_node.trainer.validator.formed_groups import FormedGroups, FormedSettings, why_not_formed

RUN = "formed-groups"
LAYOUT = StageLayout(boundaries=[0, 2, 4])


def _record(a: int, b: int, *, step: int = 3, round_: int = 1, gid: str | None = None) -> GroupRecord:
    members = [f"{a:064x}", f"{b:064x}"]
    return GroupRecord(
        group_id=gid or group_id(RUN, step, members),
        round=round_,
        policy_step=step,
        layout=LAYOUT,
        members=members,
        formed_at=1000.0,
        signed_at=1000.0,
    )


class _Dht:
    """What the DHT shows now (records already signature-checked by the swarm's reader), and a clock."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.records: dict[str, GroupRecord] = {}
        self.reads = 0

    async def read(self) -> dict[str, GroupRecord]:
        self.reads += 1
        return dict(self.records)

    def book(self, keep_s: float = 60.0) -> FormedGroups:
        return FormedGroups(
            self.read, RUN, FormedSettings(keep_s=keep_s, refresh_s=2.0), clock=lambda: self.now
        )


def test_a_file_names_a_formed_group_only_with_its_members_order_step_and_boundaries() -> None:
    record = _record(1, 2)
    assert why_not_formed(record, record.members, 3, LAYOUT) is None
    assert "no operator-signed group record" in str(why_not_formed(None, record.members, 3, LAYOUT))
    assert "stage order" in str(why_not_formed(record, record.members[::-1], 3, LAYOUT))
    assert "policy step 3, not 4" in str(why_not_formed(record, record.members, 4, LAYOUT))
    other = StageLayout(boundaries=[0, 1, 4])
    assert "cuts at [0, 2, 4]" in str(why_not_formed(record, record.members, 3, other))


def test_a_record_stays_known_for_keep_s_after_the_dht_stops_showing_it() -> None:
    dht = _Dht()
    book = dht.book(keep_s=60.0)
    record = _record(1, 2)
    dht.records[record.group_id] = record
    assert book.may_read() and not book.read_since(dht.now)
    asyncio.run(book.refresh())
    assert book.find(record.group_id) == record and book.read_since(dht.now)
    dht.now += 1.0
    assert not book.may_read()  # at most one read per refresh_s
    del dht.records[record.group_id]  # dissolved and expired: a late file of its batch is still its group's
    dht.now += 30.0
    asyncio.run(book.refresh())
    assert book.find(record.group_id) == record
    dht.now += 31.0  # 61 s after the last read that showed it
    assert book.find(record.group_id) is None
    asyncio.run(book.refresh())
    assert len(book) == 0


def test_records_whose_id_is_not_their_groups_digest_are_not_kept() -> None:
    dht = _Dht()
    book = dht.book()
    forged = _record(1, 2, gid="ab" * 32)  # signed by the operator, but no file's group id can be it
    dht.records[forged.group_id] = forged
    newer, older = _record(3, 4, round_=5), _record(3, 4, round_=2)
    dht.records[newer.group_id] = newer
    asyncio.run(book.refresh())
    assert book.find(forged.group_id) is None and len(book) == 1
    dht.records[newer.group_id] = older  # an older round read later does not replace the newer record
    asyncio.run(book.refresh())
    found = book.find(newer.group_id)
    assert found is not None and found.round == 5


def test_the_book_is_bounded_oldest_sighting_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(formed_groups, "MAX_RECORDS", 3)
    dht = _Dht()
    book = dht.book()
    first = _record(1, 2)
    dht.records[first.group_id] = first
    asyncio.run(book.refresh())
    dht.records = {r.group_id: r for r in (_record(10 + i, 20 + i) for i in range(3))}
    dht.now += 1.0
    asyncio.run(book.refresh())
    assert len(book) == 3 and book.find(first.group_id) is None
