"""Work is what it is, not its bytes; a verdict is the sender's, not the hash's. Through live validators.

Every file is made by the project's producer (node/run/producer.py) with the tiny model, handed off over the real
swarm, verified, recorded and delivered by a validator running in this process:
- copies of accepted work in another form (another Parquet compression, a prefix of the batch, the rows
  reordered, the rows with a new prompt appended) and a file repeating its own rows, each signed by the node
  that did the work, are rejected as `duplicate` naming the sample, cost the sender a fault, and credit
  nothing; also after the validator restarts. The honest control: the node's new work is accepted;
- two validators in one swarm: each batch is credited by the one validator it belongs to, and a copy sent to
  the other is refused at its door; a validator cut off in a partitioned swarm does accept a copy, and the
  trainer's inbox and batch buffer still use every sample once, also after the trainer restarts;
- a node that re-signs another's file and delivers it first is rejected (`signer`, fraud: slashed and
  banned), and the author's own delivery of the same bytes is judged on its own, accepted and credited to
  it; the author learns its own verdict through the node's API client;
- an acceptance whose samples another writer of the ledger claimed after the early check is recorded as a
  `duplicate` (the ledger's check in the recording transaction): two live validators writing one ledger judge
  two copies of one batch at once, and the one that records second loses.

The helpers read the ledger with plain SQL on the contributions table, so the tests run (and fail for the
right reason) against the code before verdicts were keyed by sender.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prime_node.node.contributor.validator_api import ValidatorApi
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import HandoffBusy, RolloutEnvelope, Swarm
from prime_node.p2p.verdicts import Verdict
from prime_node.proofs.rollout_file import encode_rows, read_rollout_file
from prime_node.proofs.rollout_schema import SCHEMA, RolloutRow
from prime_node.trainer.ledger import Ledger
from prime_node.trainer.ledger.records import load_verdict
from prime_node.trainer.ledger.slashing import SlashingPolicy
from prime_node.trainer.service.batch_buffer import BatchBuffer
from prime_node.trainer.service.consumed import ConsumedLedger
from prime_node.trainer.service.inbox import Inbox
from prime_node.trainer.validator.config import ValidatorSettings

from support.swarm import fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    announce_run,
    bind_node_ids,
    envelope_for,
    publish_checkpoint,
    rows_for,
    running_validator,
    sees_a_validator,
    validator_settings,
    write_file,
)

SECOND = Identity.from_seed(b"\x5b" * 32)  # a second validator's key, pinned beside OPERATOR
RACE_MARGIN_S = 3.0  # how long both judgements get to reach their recording while the ledger is held
POLICY = SlashingPolicy(fault_ban_after=50)  # every duplicate is slashed; none of these few bans the node


def _parquet(rows: list[RolloutRow], compression: str) -> bytes:
    """The same rows as another Parquet encoding (encode_rows writes zstd)."""
    sink = io.BytesIO()
    table = pa.Table.from_pylist([r.to_record() for r in rows], schema=SCHEMA)
    pq.write_table(table, sink, compression=compression)
    return sink.getvalue()


def _settings(data_dir: Path, inbox: Path | None = None, swarm: dict | None = None) -> ValidatorSettings:
    settings = validator_settings(data_dir, swarm).model_copy(update={"slashing": POLICY})
    if inbox is not None:
        settings = settings.model_copy(
            update={"validator": settings.validator.model_copy(update={"accepted_dir": inbox})}
        )
    return settings


async def _verdict(running, sha256: str, node_id: str, timeout: float = 60.0) -> Verdict:  # noqa: ANN001
    """The verdict on `node_id`'s delivery of the file (plain SQL: the same query works on every schema)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = await running.service.ledger.query(
            "SELECT verdict FROM contributions WHERE file_hash = ? AND node_id = ?", (sha256, node_id)
        )
        if rows:
            return load_verdict(rows[0]["verdict"]).document
        await asyncio.sleep(0.1)
    raise AssertionError(f"no verdict on {sha256[:16]}… from {node_id[:16]}… within {timeout} s")


async def _judge(running, sender: Swarm, data: bytes, signer: Identity) -> Verdict:  # noqa: ANN001
    envelope = envelope_for(signer, data)
    await sender.send_rollout(data, envelope)
    return await _verdict(running, envelope.sha256, signer.node_id)


async def _record(running, node_id: str) -> dict:  # noqa: ANN001
    ledger = running.service.ledger
    score = await ledger.query("SELECT score FROM nodes WHERE node_id = ?", (node_id,))
    slashes = await ledger.query(
        "SELECT check_class, failed_check FROM slashes WHERE node_id = ?", (node_id,)
    )
    files = await ledger.query(
        "SELECT COALESCE(SUM(accepted), 0) AS accepted, COALESCE(SUM(samples * accepted), 0) AS samples"
        " FROM contributions WHERE node_id = ?",
        (node_id,),
    )
    return {
        "score": score[0]["score"] if score else None,
        "slashes": sorted((s["check_class"], s["failed_check"]) for s in slashes),
        "accepted": files[0]["accepted"],
        "samples": files[0]["samples"],
        "banned": await ledger.active_ban(node_id) is not None,
    }


async def test_copies_of_accepted_work_are_duplicates_credited_once_also_after_a_restart(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    checkpoint, engine, tasks = world
    node = Identity.generate()
    rows = rows_for(engine, tasks, node, prompts=2)  # the batch accepted first: 2 prompts x 2 completions
    longer = rows_for(engine, tasks, node, prompts=3)  # the same batch, one assigned prompt further
    fresh = rows_for(engine, tasks, node, batch_counter=5)  # work never sent
    later = rows_for(engine, tasks, node, batch_counter=1)  # the honest control: the node's next batch
    original = encode_rows(rows)
    # Each passes every check of the proofs (the first four are accepted by a validator that knows only file
    # hashes), and each repeats samples: accepted ones, or its own.
    copies = {
        "another compression": (_parquet(rows, "gzip"), "already accepted"),
        "a prefix": (encode_rows(rows[:2]), "already accepted"),
        "a new prompt appended": (encode_rows(rows + longer[4:]), "already accepted"),
        "reordered": (encode_rows(rows[::-1]), "already accepted"),
        "its own rows twice": (encode_rows(fresh + fresh), "row 2: repeats row 0 of this file"),
    }
    settings = _settings(tmp_path / "validator")
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        sender = await group.add(node, bootstrap=running.maddrs[:1], reachability="public")
        await wait_until(lambda: sees_a_validator(sender), 15)
        first = await _judge(running, sender, original, node)
        assert first.accepted, first.reason
        for name, (data, fragment) in copies.items():
            verdict = await _judge(running, sender, data, node)
            assert not verdict.accepted and verdict.failed_check == "duplicate", (name, verdict.reason)
            assert verdict.reason.startswith("row "), (name, verdict.reason)
            assert fragment in verdict.reason, (name, verdict.reason)
            if fragment == "already accepted":  # the reason names the sample and the file that holds it
                assert f"in file {first.file_hash}" in verdict.reason and "sample index" in verdict.reason
        control = await _judge(running, sender, encode_rows(later), node)
        assert control.accepted, control.reason
        record = await _record(running, node.node_id)
        faults = len(copies)
        assert record == {
            "score": 2 * POLICY.accept_credit - faults * POLICY.fault_penalty,
            "slashes": [("fault", "duplicate")] * faults,
            "accepted": 2,
            "samples": len(rows) + len(later),
            "banned": False,
        }, record

    # A file acknowledged by a validator of the version before, still in its spool under the hash alone, with
    # the envelope nodes wrote then (format v1, no batch): judged as any other file it had acknowledged.
    legacy = encode_rows(rows_for(engine, tasks, node, batch_counter=2))
    envelope = RolloutEnvelope.sign(node, legacy, None)
    assert envelope.format == "prime-node/rollout-sig/v1"
    spool = settings.resolved_data_dir() / "spool"
    (spool / f"{envelope.sha256}.parquet.sig").write_bytes(envelope.model_dump_json().encode())
    (spool / f"{envelope.sha256}.parquet").write_bytes(legacy)

    # The ledger remembers the accepted samples across a restart of the validator.
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        recovered = await _verdict(
            running, envelope.sha256, node.node_id
        )  # its sender read from its signature
        assert recovered.accepted, recovered.reason
        sender = await group.add(node, bootstrap=running.maddrs[:1], reachability="public")
        await wait_until(lambda: sees_a_validator(sender), 15)
        again = ((_parquet(rows, "none"), first.file_hash), (_parquet(later, "gzip"), control.file_hash))
        for data, holder in again:
            verdict = await _judge(running, sender, data, node)
            assert verdict.failed_check == "duplicate", verdict.reason
            assert f"in file {holder}" in verdict.reason, verdict.reason
        record = await _record(running, node.node_id)
        assert (record["accepted"], record["samples"]) == (3, len(rows) + 2 * len(later))
        assert record["score"] == 3 * POLICY.accept_credit - (faults + 2) * POLICY.fault_penalty
        await wait_until(lambda: _count(spool, 0), 10)
    delivered = sorted((settings.resolved_data_dir() / "accepted").glob("*.parquet"))
    assert len(delivered) == 3  # the three accepted files reached the trainer's inbox, nothing else


async def test_an_acceptance_that_loses_the_race_for_its_samples_is_recorded_as_a_duplicate(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    """The early check reads the ledger before the costly checks; a claim can land after it. Two validators
    write one ledger (each alone in its swarm, so each owns every batch) and are each handed a copy of the same
    batch (two encodings) while a third writer holds the ledger's write lock: both copies pass the early check
    (reads go on), both recordings wait for the lock, and once it is released one records first. The ledger's
    own check in the other's recording transaction turns that acceptance into a `duplicate` instead of
    crediting the samples twice. The honest control: each validator's judgement of the node's other batches."""
    checkpoint, engine, tasks = world
    node = Identity.generate()
    rows = rows_for(engine, tasks, node)
    controls = [encode_rows(rows_for(engine, tasks, node, batch_counter=k)) for k in (1, 2)]
    shared = {"path": tmp_path / "shared-ledger.sqlite"}
    first, second = (_settings(tmp_path / name) for name in ("v1", "v2"))
    first, second = (
        s.model_copy(update={"ledger": s.ledger.model_copy(update=shared)}) for s in (first, second)
    )
    for settings in (first, second):
        publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    copies = [encode_rows(rows), _parquet(rows, "gzip")]
    envelopes = [envelope_for(node, data) for data in copies]
    async with (
        running_validator(first) as v1,
        running_validator(second) as v2,
        fleet(RUN, OPERATOR) as group,
    ):
        to_v1 = await group.add(node, bootstrap=v1.maddrs[:1], reachability="public")
        to_v2 = await group.add(node, bootstrap=v2.maddrs[:1], reachability="public")
        for running, sender, data in ((v1, to_v1, controls[0]), (v2, to_v2, controls[1])):
            await wait_until(lambda sender=sender: sees_a_validator(sender), 15)
            assert (
                await _judge(running, sender, data, node)
            ).accepted  # and each validator's model is loaded
        with Ledger(shared["path"]) as writer, writer.db.write():  # another writer holds the write lock
            for sender, data, envelope in zip((to_v1, to_v2), copies, envelopes, strict=True):
                await sender.send_rollout(data, envelope)
            await wait_until(lambda: _taken(v1, v2), 15)  # both judging: the early check reads on
            await asyncio.sleep(RACE_MARGIN_S)  # both past it (judging takes ~0.2 s), waiting to record
            assert v1.service.verdicts == v2.service.verdicts == 1  # the controls alone
        verdicts = [
            await _verdict(running, e.sha256, node.node_id)
            for running, e in zip((v1, v2), envelopes, strict=True)
        ]
    assert sorted(v.accepted for v in verdicts) == [False, True], verdicts
    won, lost = sorted(verdicts, key=lambda v: not v.accepted)
    assert lost.failed_check == "duplicate", lost
    # The ledger's check named it (DuplicateWork), not the early one ("row N: ..." and the full hash).
    assert lost.reason.startswith("sample (") and f"file {won.file_hash[:16]}…" in lost.reason, lost
    with Ledger(shared["path"]) as ledger:
        record = ledger.query(
            "SELECT COALESCE(SUM(accepted), 0) AS files, COALESCE(SUM(samples * accepted), 0) AS samples"
            " FROM contributions WHERE node_id = ?",
            (node.node_id,),
        )[0]
        slashes = ledger.query(
            "SELECT check_class, failed_check FROM slashes WHERE node_id = ?", (node.node_id,)
        )
    assert (record["files"], record["samples"]) == (3, 3 * len(rows)), dict(
        record
    )  # the controls, the winner
    assert [(s["check_class"], s["failed_check"]) for s in slashes] == [("fault", "duplicate")]


async def _taken(*validators) -> bool:  # noqa: ANN002
    """Every validator's worker has taken its file from the queue (and holds none waiting for a checkpoint)."""
    return all(len(v.service.queue) == 0 and not v.service.held for v in validators)


async def test_two_validators_in_one_swarm_credit_each_batch_once_and_the_trainer_uses_it_once(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    """Two validators announced in one DHT, delivering into the trainer's one inbox. Each batch belongs to one of
    them (p2p/swarm/routing.py): the node's files go there and are credited once; the same file sent to the other
    validator is answered busy at its door and never read, judged or credited (each validator used to credit
    the copy it was sent; only the trainer noticed). A third validator cut off in a swarm of its own (a
    partition: it sees no other validator, so every batch is its own) does accept a re-encoded copy: the
    trainer, the defence in depth, still uses each sample once, also after it restarts."""
    checkpoint, engine, tasks = world
    node = Identity.from_seed(b"\x34" * 32)  # fixed: its batch 0 belongs to SECOND, its batch 1 to OPERATOR
    rows = rows_for(engine, tasks, node, prompts=2)
    control = rows_for(engine, tasks, node, prompts=2, batch_counter=1)
    files = [write_file(tmp_path / f"batch-{k}.parquet", r, node) for k, r in enumerate((rows, control))]
    inbox = tmp_path / "trainer" / "accepted"  # every validator delivers into the trainer's one inbox
    keys = {"operator_keys": [OPERATOR.node_id, SECOND.node_id]}
    first = _settings(tmp_path / "v1", inbox, keys)
    publish_checkpoint(checkpoint, first.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(first, announce=False) as v1, fleet(RUN, OPERATOR) as group:
        second = _settings(tmp_path / "v2", inbox, {**keys, "initial_peers": v1.maddrs[:1]})
        publish_checkpoint(checkpoint, second.resolved_data_dir() / "validator-weights", 0)
        async with running_validator(second, announce=False, identity=SECOND) as v2:
            await announce_run(v1.swarm, first.run)
            sender = await group.add(node, bootstrap=v1.maddrs[:1], reachability="public", **keys)
            await wait_until(lambda: _live_validators(sender, 2), 15)
            announced = await sender.live_validators()
            by_id = {OPERATOR.node_id: v1, SECOND.node_id: v2}
            owners = []
            for path, envelope in files:
                receipt = await sender.send_rollout(path, envelope)  # to the validator the batch belongs to
                owners.append(receipt.body.receiver)
                verdict = await _verdict(by_id[receipt.body.receiver], envelope.sha256, node.node_id)
                assert verdict.accepted, verdict.reason
                other = next(v for v in announced.values() if v.node_id != receipt.body.receiver)
                with pytest.raises(HandoffBusy, match="not assigned here"):  # the same file, to the other one
                    await sender.send_rollout(path, envelope, other)
            assert owners == [SECOND.node_id, OPERATOR.node_id]  # each validator owns one of the two batches
            for running in (v1, v2):  # credited once in the swarm: by its owner, nowhere else
                record = await _record(running, node.node_id)
                assert (record["accepted"], record["samples"]) == (1, 4), record
                assert record["slashes"] == [], record  # no fault for the copy: a header proves nothing
            await wait_until(
                lambda: _count(inbox, 2), 15
            )  # each verdict is recorded, then the file delivered
    partitioned = _settings(tmp_path / "v3", inbox)
    publish_checkpoint(checkpoint, partitioned.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(partitioned) as v3, fleet(RUN, OPERATOR) as group:
        cut_off = await group.add(node, bootstrap=v3.maddrs[:1], reachability="public")
        await wait_until(lambda: sees_a_validator(cut_off), 15)
        verdict = await _judge(v3, cut_off, _parquet(rows, "gzip"), node)
        assert verdict.accepted, verdict.reason
        await wait_until(lambda: _count(inbox, 3), 15)

    expected = {(r.policy_step, r.batch_counter, r.sample_index, r.sample_seed) for r in rows + control}
    with ConsumedLedger(tmp_path / "trainer" / "consumed.sqlite") as consumed:
        reader = Inbox(inbox, RUN)
        buffer = BatchBuffer(consumed, batch_size=2, async_level=2)
        reports = [buffer.add(reader.read(path), 0) for path in reader.pending()]  # oldest first
        assert [(r.kept + r.filtered, r.already_known) for r in reports] == [(2, 0), (2, 0), (0, 2)], reports
        trained: list[str] = []
        while (batch := buffer.take(0)) is not None:
            trained += [s.sample_id for g in batch.groups for s in g.samples]
            buffer.commit(batch)
        assert len(trained) == len(set(trained))  # no sample twice
        every = [s.sample_id for path in inbox.glob("*.parquet") for s in reader.read(path).samples]
        assert consumed.seen_samples(every) == set(every) and len(set(every)) == len(expected)
    # A restarted trainer re-reads the inbox and takes nothing again, whichever copy it meets first.
    with ConsumedLedger(tmp_path / "trainer" / "consumed.sqlite") as consumed:
        reader = Inbox(inbox, RUN)
        buffer = BatchBuffer(consumed, batch_size=2, async_level=2)
        for path in sorted(reader.pending(), reverse=True):
            report = buffer.add(reader.read(path), 0)
            assert (report.kept, report.filtered, report.already_known) == (0, 0, 2), (path.name, report)
    assert {
        (r.policy_step, r.batch_counter, r.sample_index, r.sample_seed)
        for p in inbox.glob("*.parquet")
        for r in read_rollout_file(p).rows
    } == expected


async def test_a_resend_of_a_file_spooled_under_its_legacy_name_is_acknowledged_not_received_again(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    """A file acknowledged by a validator of the version before sits in the spool as `<sha>.parquet` without a
    verdict when the validator restarts; its sender, unsure it was received, sends it again. It used to be
    stored a second time under the new name, verified twice and delivered twice to the trainer."""
    checkpoint, engine, tasks = world
    node = Identity.generate()
    old, new = (encode_rows(rows_for(engine, tasks, node, batch_counter=k)) for k in (0, 1))
    settings = _settings(tmp_path / "validator")
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    spool = settings.resolved_data_dir() / "spool"
    spool.mkdir(parents=True)
    legacy = RolloutEnvelope.sign(node, old, None)  # v1, as that version signed it
    (spool / f"{legacy.sha256}.parquet.sig").write_bytes(legacy.model_dump_json().encode())
    (spool / f"{legacy.sha256}.parquet").write_bytes(old)
    # Not announced yet: verification waits for the run's confirmation, so the legacy file is still unjudged.
    async with running_validator(settings, announce=False) as running, fleet(RUN, OPERATOR) as group:
        sender = await group.add(node, bootstrap=running.maddrs[:1], reachability="public")
        await wait_until(lambda: sees_a_validator(sender), 15)
        # The node re-signs a pending v1 file as v2 before sending it again (proofs/rollout_file.py).
        receipt = await sender.send_rollout(old, RolloutEnvelope.sign(node, old, (0, 0)))
        assert receipt.body.sha256 == legacy.sha256 and receipt.body.sender == node.node_id
        fresh = RolloutEnvelope.sign(
            node, new, (0, 1)
        )  # the honest control: a new file is received and spooled
        await sender.send_rollout(new, fresh)
        assert sorted(p.name for p in spool.glob("*.parquet")) == sorted(
            [f"{legacy.sha256}.parquet", f"{fresh.sha256}-{node.node_id}.parquet"]
        )
        await announce_run(running.swarm, settings.run)
        for envelope in (legacy, fresh):
            assert (await _verdict(running, envelope.sha256, node.node_id)).accepted
        await wait_until(lambda: _count(spool, 0), 10)
        inbox = settings.resolved_data_dir() / "accepted"
        await wait_until(lambda: _count(inbox, 2), 10)
        await asyncio.sleep(0.5)  # a second delivery of the legacy file would land now
        assert len(list(inbox.glob(f"{legacy.sha256}*.parquet"))) == 1
        assert running.service.verdicts == 2  # each file judged once


async def _live_validators(swarm: Swarm, n: int) -> bool:
    return len(await swarm.live_validators(fresh=True)) == n


async def _count(directory: Path, n: int) -> bool:
    return len(list(directory.glob("*.parquet"))) == n


async def test_a_front_runner_is_rejected_and_the_authors_own_delivery_is_accepted_and_credited(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    checkpoint, engine, tasks = world
    victim, thief, racer = Identity.generate(), Identity.generate(), Identity.generate()
    work = encode_rows(rows_for(engine, tasks, victim))
    more = encode_rows(rows_for(engine, tasks, victim, batch_counter=1))
    settings = _settings(tmp_path / "validator")
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        host = await group.add(bootstrap=running.maddrs[:1], reachability="public")
        await bind_node_ids(host, [victim, thief, racer])  # one host speaks for all three nodes
        await wait_until(lambda: sees_a_validator(host), 15)

        # The thief re-signs the victim's file and delivers it first; it is judged before the victim sends.
        stolen = await _judge(running, host, work, thief)
        assert not stolen.accepted and stolen.failed_check == "signer", stolen.reason
        own = await _judge(running, host, work, victim)  # the same bytes, the author's own envelope
        assert own.accepted and own.node_id == victim.node_id, own.reason
        assert own.file_hash == stolen.file_hash

        # A racer re-signs the next file and delivers it just before the author: both spooled at once.
        await host.send_rollout(more, envelope_for(racer, more))
        await host.send_rollout(more, envelope_for(victim, more))
        sha = envelope_for(victim, more).sha256
        raced = await _verdict(running, sha, racer.node_id)
        mine = await _verdict(running, sha, victim.node_id)
        assert raced.failed_check == "signer" and mine.accepted, (raced.reason, mine.reason)

        # A resend by the author is a resend: acknowledged again, credited once.
        receipt = await host.send_rollout(work, envelope_for(victim, work))
        assert receipt.body.sha256 == own.file_hash and receipt.body.sender == victim.node_id
        await asyncio.sleep(1.0)
        assert await _record(running, victim.node_id) == {
            "score": 2 * POLICY.accept_credit,
            "slashes": [],
            "accepted": 2,
            "samples": 4,
            "banned": False,
        }
        for cheat in (thief, racer):  # fraud: slashed and banned at once
            record = await _record(running, cheat.node_id)
            assert record["slashes"] == [("fraud", "signer")] and record["banned"] and record["accepted"] == 0

        # The author asks for its own verdict, as its daemon does, and gets it, not the thief's.
        api = ValidatorApi(host, victim.node_id, timeout_s=5.0)
        try:
            endpoint = (await api.endpoints())[OPERATOR.node_id]
            signed = await api.verdict(endpoint, own.file_hash)
        finally:
            await api.close()
        assert signed.document == own
        # The hash alone no longer names one verdict: the old route says so instead of answering either.
        url = f"{running.dashboard_url}/api/verdict/{own.file_hash}"
        with pytest.raises(urllib.error.HTTPError) as answer:
            await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        assert answer.value.code == 409 and "several nodes" in json.loads(answer.value.read())["error"]
        url = f"{running.dashboard_url}/api/verdict/{stolen.file_hash}/{thief.node_id}"
        raw = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        assert json.loads(raw)["document"]["failed_check"] == "signer"
        # Only the author's deliveries reach the trainer.
        inbox = settings.resolved_data_dir() / "accepted"
        await wait_until(lambda: _count(inbox, 2), 10)
        assert {read_rollout_file(p).signer for p in inbox.glob("*.parquet")} == {victim.node_id}
