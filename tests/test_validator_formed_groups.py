"""The validator's book of operator-signed group records (trainer/validator/formed_groups.py): which group a
file may name, how long a record stays known after the DHT stops showing it, its bound, a lookup that found
nothing (not an answer), and the records kept on disk across a restart (opened again, signatures checked)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest

from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.swarm.directory import SealedRecord
from prime_node.p2p.swarm.group_records import GroupRecord, group_id
from prime_node.p2p.swarm.kinds import RecordKind
from prime_node.p2p.swarm.records import seal
from prime_node.trainer.validator import formed_groups
from prime_node.trainer.validator.formed_groups import FormedGroups, FormedSettings, why_not_formed

from support.nonces import nonce_at

RUN = "formed-groups"
LAYOUT = StageLayout(boundaries=[0, 2, 4])
OPERATOR = Identity.from_seed(b"\x31" * 32)


def _record(
    a: int, b: int, *, step: int = 3, round_: int = 1, gid: str | None = None, salt: int = 0x5A
) -> GroupRecord:
    members = [f"{a:064x}", f"{b:064x}"]
    nonce = nonce_at(1000.0, salt)
    return GroupRecord(
        group_id=gid or group_id(RUN, step, members, LAYOUT, nonce),
        round=round_,
        policy_step=step,
        layout=LAYOUT,
        members=members,
        formed_at=1000.0,
        signed_at=1000.0,
        nonce=nonce,
    )


def _sealed(record: GroupRecord, signer: Identity = OPERATOR) -> SealedRecord:
    """The record as the swarm's reader returns it: its body and the signed DHT value it came in."""
    expiration = 2000.0
    return SealedRecord(
        record, seal(signer, RUN, RecordKind.GROUP, record.group_id, record, expiration), expiration
    )


class _Dht:
    """What the DHT shows now (records already signature-checked by the swarm's reader), and a clock.

    `found`: False makes a lookup that found no table (the swarm's reader answers None)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.records: dict[str, GroupRecord] = {}
        self.found = True
        self.reads = 0

    async def read(self) -> dict[str, SealedRecord] | None:
        self.reads += 1
        if not self.found:
            return None
        return {gid: _sealed(record) for gid, record in self.records.items()}

    def book(self, keep_s: float = 60.0, path: Path | None = None) -> FormedGroups:
        return FormedGroups(
            self.read,
            RUN,
            FormedSettings(keep_s=keep_s, refresh_s=2.0),
            operator_keys=frozenset({OPERATOR.node_id}),
            path=path,
            clock=lambda: self.now,
        )


def test_a_file_names_a_formed_group_only_with_its_members_order_step_and_layout() -> None:
    record = _record(1, 2)
    assert why_not_formed(record, record.members, 3, LAYOUT) is None
    assert "no operator-signed group record" in str(why_not_formed(None, record.members, 3, LAYOUT))
    assert "stage order" in str(why_not_formed(record, record.members[::-1], 3, LAYOUT))
    assert "policy step 3, not 4" in str(why_not_formed(record, record.members, 4, LAYOUT))
    other = StageLayout(boundaries=[0, 1, 4])
    assert "boundaries [0, 2, 4], the run's [0, 1, 4]" in str(
        why_not_formed(record, record.members, 3, other)
    )
    # The batch's shape is the run's too: a record for batches of other prompts or micro-batches forms nothing.
    other = StageLayout(boundaries=[0, 2, 4], prompts=8, micro_batch_size=4)
    why = str(why_not_formed(record, record.members, 3, other))
    assert "prompts 4, the run's 8" in why and "micro_batch_size 2, the run's 4" in why


def test_a_record_stays_known_for_keep_s_after_the_dht_stops_showing_it() -> None:
    dht = _Dht()
    book = dht.book(keep_s=60.0)
    record = _record(1, 2)
    dht.records[record.group_id] = record
    assert book.may_read() and not book.answered_since(dht.now)
    assert asyncio.run(book.refresh())  # learned a record
    assert book.find(record.group_id) == record and book.answered_since(dht.now)
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
    # The id of the same members under another formation's nonce: the validator recomputes it with the nonce.
    renonced = _record(1, 2, gid=_record(1, 2, salt=0x11).group_id)
    dht.records[renonced.group_id] = renonced
    newer, older = _record(3, 4, round_=5), _record(3, 4, round_=2)
    dht.records[newer.group_id] = newer
    asyncio.run(book.refresh())
    assert book.find(forged.group_id) is None and book.find(renonced.group_id) is None and len(book) == 1
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


def test_a_lookup_that_found_no_table_is_tried_but_no_answer() -> None:
    # hivemind answers a lookup that reached none of the peers holding the records as it answers for a key
    # nobody stores: a file must not take that for "no such group".
    dht = _Dht()
    book = dht.book()
    dht.found = False
    assert not asyncio.run(book.refresh())
    assert dht.reads == 1 and not book.may_read() and not book.answered_since(dht.now)
    dht.now += 2.0
    dht.found = True  # the table, without the group: an answer (the service still waits out the file's grace)
    assert not asyncio.run(book.refresh())
    assert book.answered_since(dht.now) and not book.answered_since(dht.now + 0.5)


def test_records_are_kept_on_disk_and_opened_again_with_their_signatures(tmp_path: Path) -> None:
    path = tmp_path / "group-records.json"
    dht = _Dht()
    book = dht.book(keep_s=60.0, path=path)
    kept, other = _record(1, 2), _record(3, 4)
    dht.records = {kept.group_id: kept, other.group_id: other}
    learned = asyncio.run(book.refresh())
    assert learned and book.should_save(learned)
    book.write(book.snapshot())
    assert not book.should_save(False)  # saved just now; again after keep_s / 8
    # A restart 50 s later: the DHT no longer has the records (dissolved, expired), the file does.
    dht.now += 50.0
    dht.records = {}
    again = dht.book(keep_s=60.0, path=path)
    assert again.load() == 2 and again.find(kept.group_id) == kept
    dht.now += 11.0  # keep_s counts from the sighting on disk, not from the restart
    assert again.find(kept.group_id) is None
    # A record whose signed value was altered, or that no pinned operator key signed, does not come back.
    document = json.loads(path.read_bytes())
    rows = document["records"]
    forged = _record(5, 6)
    stranger = _sealed(forged, Identity.from_seed(b"\x32" * 32))
    rows.append(
        {
            "group_id": forged.group_id,
            "value": base64.b64encode(stranger.value).decode(),
            "expiration": 2000.0,
            "seen": 1040.0,
        }
    )
    tampered = dict(rows[0])
    value = bytearray(base64.b64decode(tampered["value"]))
    value[-3] ^= 1
    tampered["value"] = base64.b64encode(bytes(value)).decode()
    rows[0] = tampered
    rows.append({"group_id": "ab" * 32, "value": "not base64!", "expiration": 2000.0, "seen": 1040.0})
    path.write_text(json.dumps(document))
    dht.now = 1050.0
    third = dht.book(keep_s=60.0, path=path)
    assert third.load() == 1
    assert third.find(other.group_id) == other
    assert third.find(forged.group_id) is None and third.find(kept.group_id) is None
    path.write_text("{")  # an unreadable file is ignored, not fatal
    assert dht.book(path=path).load() == 0
