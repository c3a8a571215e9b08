"""The SQLite ledger: migrations, idempotence on resend, crediting, slashing applied, bans, concurrency."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from prime_node.p2p.verdicts import sign
from prime_node.proofs.work_identity import SampleId
from prime_node.trainer.ledger import AsyncLedger, DuplicateWork, Ledger, LedgerError
from prime_node.trainer.ledger.schema import CREATE_MIGRATIONS_TABLE, LATEST_VERSION, MIGRATIONS
from prime_node.trainer.ledger.slashing import Ban, Credit, Slash, SlashingPolicy

from support.ledger import T0, VALIDATOR, node_id, signed_verdict

A, B = node_id(10), node_id(11)


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as led:
        yield led


def _totals(ledger: Ledger, node: str) -> tuple[int, int, float]:
    row = ledger.query(
        "SELECT SUM(tokens * accepted), SUM(samples * accepted), (SELECT score FROM nodes WHERE node_id = ?)"
        " FROM contributions WHERE node_id = ?",
        (node, node),
    )[0]
    return row[0], row[1], row[2]


def test_fresh_ledger_is_wal_and_at_the_latest_schema(tmp_path):
    path = tmp_path / "sub" / "ledger.sqlite"
    Ledger(path).close()
    with Ledger(path) as reopened:  # reopening applies nothing twice
        assert reopened.schema_version() == LATEST_VERSION
        assert len(reopened.query("SELECT * FROM schema_migrations")) == LATEST_VERSION
        assert reopened.query("PRAGMA journal_mode")[0][0] == "wal"


def test_a_ledger_from_a_newer_version_is_refused(tmp_path):
    path = tmp_path / "ledger.sqlite"
    Ledger(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO schema_migrations VALUES (?, 'from the future', 0)", (LATEST_VERSION + 1,))
    with pytest.raises(LedgerError, match="upgrade prime-node"):
        Ledger(path)


def test_accepted_file_is_credited_once_even_when_resent(ledger):
    first = signed_verdict(A, tokens=300, samples=6)
    result = ledger.record(first, received_at=T0 - 2)
    assert not result.duplicate and result.actions == (Credit(1.0),)
    # The resend is verified again by a (racing) validator, which signs a second verdict at another time.
    second = sign(first.document.model_copy(update={"decided_at": T0 + 60}), VALIDATOR)
    again = ledger.record(second)
    assert again.duplicate and again.actions == () and again.verdict == first
    assert ledger.verdict_for(first.document.file_hash, A) == first
    assert ledger.verdict_for(first.document.file_hash, B) is None  # a verdict belongs to (file, sender)
    assert _totals(ledger, A) == (300, 6, 1.0)


def test_crediting_sums_over_files_and_nodes(ledger):
    for tokens in (100, 200, 300):
        ledger.record(signed_verdict(A, tokens=tokens, samples=4))
    ledger.record(signed_verdict(B, tokens=50, samples=2))
    ledger.record(signed_verdict(B, accepted=False, failed_check="schema", tokens=10**6))
    assert _totals(ledger, A) == (600, 12, 3.0)
    assert _totals(ledger, B) == (50, 2, 1.0 - 5.0)
    assert ledger.verdict_for("f" * 64, A) is None


def test_a_pipelined_stage_file_is_credited_its_share_and_the_share_is_kept(ledger):
    # Each stage of a group is credited its share of the layers: the group's batch earns one unit in all.
    for share in (0.25, 0.75):
        result = ledger.record(signed_verdict(A, tokens=10, samples=2), credit_share=share)
        assert result.actions == (Credit(share),)
    assert _totals(ledger, A) == (20, 4, 1.0)
    rejected = signed_verdict(A, accepted=False, failed_check="pipeline_group")
    ledger.record(rejected, credit_share=0.5)  # no credit, no share recorded
    shares = ledger.query(
        "SELECT credit_share FROM contributions WHERE node_id = ? ORDER BY credit_share", (A,)
    )
    assert [r["credit_share"] for r in shares] == [None, 0.25, 0.75]
    for bad in (0.0, 1.5, float("nan"), -0.5):
        with pytest.raises(LedgerError, match="credit_share"):
            ledger.record(signed_verdict(B), credit_share=bad)


def test_fraud_is_slashed_and_banned_in_the_same_transaction(ledger):
    ledger.record(signed_verdict(A, at=T0))
    result = ledger.record(signed_verdict(A, accepted=False, failed_check="toploc", at=T0 + 10))
    assert [type(a) for a in result.actions] == [Slash, Ban]
    (ban,) = result.new_bans
    assert (
        ban.node_id == A
        and ban.until == T0 + 10 + 86400
        and ban.file_hash == result.verdict.document.file_hash
    )
    assert ledger.active_ban(A, now=T0 + 20) == ban
    assert ledger.active_ban(A, now=T0 + 10 + 86400) is None  # expired
    slashes = ledger.query("SELECT amount, check_class, failed_check FROM slashes WHERE node_id = ?", (A,))
    assert [tuple(r) for r in slashes] == [(100.0, "fraud", "toploc")]
    assert ledger.history(A, now=T0 + 20).score == 1.0 - 100.0


def test_repeated_faults_escalate_and_later_bans_grow(tmp_path):
    policy = SlashingPolicy(
        fault_ban_after=3, fault_window_s=600, fault_ban_s=100, ban_growth=2, permanent_after_bans=2
    )
    with Ledger(tmp_path / "l.sqlite", policy) as ledger:
        bans = []
        for i in range(9):
            result = ledger.record(signed_verdict(A, accepted=False, failed_check="bounds", at=T0 + 200 * i))
            bans += result.new_bans
        # Faults 3, 6 and 9 (the counter restarts after each ban): 100 s, then 200 s, then for good.
        assert [(b.created_at - T0, None if b.until is None else b.until - b.created_at) for b in bans] == [
            (400, 100),
            (1000, 200),
            (1600, None),
        ]
        assert ledger.active_ban(A, now=T0 + 10**8).until is None


def test_unauthenticated_rejections_touch_no_node(ledger):
    result = ledger.record(signed_verdict(B, accepted=False, failed_check="signature"))
    assert result.actions == () and not result.duplicate
    assert ledger.query("SELECT COUNT(*) FROM nodes")[0][0] == 0
    assert ledger.record(result.verdict).duplicate  # still idempotent


def test_node_metadata_and_hostile_hardware(ledger):
    ledger.touch_node(A, seen_at=T0, hardware={"gpu": "H100", "gpu_memory_gb": 80, "cpu_cores": 16})
    ledger.touch_node(A, seen_at=T0 - 100)  # an older heartbeat arriving late does not move last_seen back
    row = ledger.query("SELECT first_seen, last_seen, hardware FROM nodes WHERE node_id = ?", (A,))[0]
    assert (row[0], row[1]) == (T0, T0) and '"gpu":"H100"' in row[2]
    for bad in (
        {"gpu": "x" * 1000},
        {"nested": {"a": 1}},
        {"k" * 100: 1},
        {"nan": float("nan")},
        {f"k{i}": "v" * 200 for i in range(30)},
    ):
        with pytest.raises(LedgerError):
            ledger.touch_node(A, hardware=bad)
    with pytest.raises(LedgerError, match="64 lowercase hex"):
        ledger.touch_node("A" * 64)


def test_hardware_from_a_swarm_heartbeat_is_stored_as_sent(ledger):
    from prime_node.p2p.swarm.records import Hardware  # noqa: PLC0415 - imports hivemind; only this test needs it

    hardware = Hardware(
        gpu_model="NVIDIA H100 80GB HBM3", gpu_memory_mb=81559, cpu="x86_64", cpu_cores=16, ram_mb=131072
    )
    ledger.touch_node(A, seen_at=T0, hardware=hardware.model_dump())
    stored = ledger.query("SELECT hardware FROM nodes WHERE node_id = ?", (A,))[0][0]
    assert Hardware.model_validate_json(stored) == hardware


def test_operator_bans_lifts_and_records(ledger):
    ban = ledger.ban(B, "manual", until=None, at=T0)
    assert ledger.active_bans(now=T0 + 10**9) == [ban]
    from prime_node.p2p.verdicts import BanRecord  # noqa: PLC0415 - only this test needs it

    record = sign(ban.to_record(VALIDATOR.node_id), VALIDATOR)
    assert isinstance(record.document, BanRecord)
    ledger.attach_ban_record(ban.id, record)
    assert ledger.active_ban(B, now=T0 + 1).record == record.to_json().decode()
    assert ledger.lift_bans(B, at=T0 + 5) == 1
    assert ledger.active_ban(B, now=T0 + 6) is None and ledger.history(B, now=T0 + 6).bans_so_far == 0
    with pytest.raises(LedgerError, match="no ban"):
        ledger.attach_ban_record(9999, record)
    with pytest.raises(LedgerError, match="not after"):
        ledger.ban(B, "bad", until=T0, at=T0)
    with pytest.raises(LedgerError, match="1 to 256 characters"):
        ledger.ban(B, "x" * 257, until=None, at=T0)


def test_concurrent_receipts_of_one_file_credit_it_once(tmp_path):
    path = tmp_path / "ledger.sqlite"
    signed = signed_verdict(A, tokens=77)
    ledgers = [Ledger(path) for _ in range(2)]  # two connections, as two processes would have
    results: list = []
    barrier = threading.Barrier(8)

    def worker(led: Ledger) -> None:
        barrier.wait()
        results.append(led.record(signed))

    threads = [threading.Thread(target=worker, args=(ledgers[i % 2],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(r.duplicate for r in results) == [False] + [True] * 7
    assert _totals(ledgers[0], A) == (77, 8, 1.0)
    for led in ledgers:
        led.close()


async def test_async_wrapper_runs_off_the_loop(ledger):
    aledger = AsyncLedger(ledger)
    signed = signed_verdict(A)
    assert not (await aledger.record(signed)).duplicate
    assert (await aledger.record(signed)).duplicate
    assert await aledger.verdict_for(signed.document.file_hash, A) == signed
    await aledger.touch_node(B, seen_at=T0, hardware={"cpu": "x86"})
    assert await aledger.active_ban(B, now=T0) is None
    assert len(await aledger.query("SELECT * FROM nodes")) == 2
    ban = await aledger.ban(B, "manual", until=T0 + 60, at=T0)
    await aledger.attach_ban_record(ban.id, sign(ban.to_record(VALIDATOR.node_id), VALIDATOR))
    assert [b.id for b in await aledger.active_bans(now=T0 + 1)] == [ban.id]


def _ids(node: str, batch: int, n: int, *, step: int = 3) -> list[SampleId]:
    return [SampleId("run", node, step, batch, 100 + i // 2, 7_000 + i) for i in range(n)]


def test_a_sample_is_accepted_once_whatever_file_carries_it(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        first = signed_verdict(A, samples=4)
        ledger.record(first, samples=_ids(A, 0, 4))
        # Another file (another encoding, a prefix, a superset...) claiming one of those samples: nothing is
        # written, and the error names the sample and the file that holds it.
        superset = signed_verdict(A, samples=6)
        with pytest.raises(DuplicateWork, match=f"seed 7000.*file {first.document.file_hash[:16]}") as caught:
            ledger.record(superset, samples=_ids(A, 0, 6))
        assert caught.value.holder == first.document.file_hash and caught.value.sample == _ids(A, 0, 4)[0]
        assert ledger.verdict_for(superset.document.file_hash, A) is None
        with pytest.raises(DuplicateWork, match="repeated row"):  # a file repeating its own rows
            ledger.record(signed_verdict(A, samples=2), samples=_ids(A, 1, 1) * 2)
        assert _totals(ledger, A) == (256, 4, 1.0)  # credited once
        assert ledger.accepted_holder(_ids(A, 1, 2) + _ids(A, 0, 1)) == (
            _ids(A, 0, 1)[0],
            first.document.file_hash,
        )
        ledger.record(signed_verdict(A, samples=2), samples=_ids(A, 1, 2))  # new work is accepted
        with pytest.raises(LedgerError, match="another node"):  # identities are the sender's own
            ledger.record(signed_verdict(B, samples=2), samples=_ids(A, 2, 2))
    with Ledger(path) as reopened:  # a restart forgets nothing
        assert reopened.accepted_holder(_ids(A, 0, 4)[2:]) == (_ids(A, 0, 4)[2], first.document.file_hash)


def test_two_writers_cannot_both_accept_the_same_sample(tmp_path):
    path = tmp_path / "ledger.sqlite"
    ledgers = [Ledger(path) for _ in range(2)]  # two connections, as two processes would have
    barrier = threading.Barrier(6)
    outcomes: list[str] = []

    def worker(i: int) -> None:
        # Six files, each a different cut of the same batch: samples 0..i+1 of it.
        signed = signed_verdict(A, samples=i + 2)
        barrier.wait()
        try:
            ledgers[i % 2].record(signed, samples=_ids(A, 0, i + 2))
            outcomes.append("accepted")
        except DuplicateWork:
            outcomes.append("duplicate")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(outcomes) == ["accepted"] + ["duplicate"] * 5
    assert len(ledgers[0].query("SELECT * FROM contributions")) == 1
    for led in ledgers:
        led.close()


def test_a_verdict_belongs_to_the_file_and_its_sender(ledger):
    stolen = signed_verdict(B, accepted=False, failed_check="signer")  # B re-signed A's file, delivered first
    own = signed_verdict(A, file_hash=stolen.document.file_hash, samples=2)
    assert not ledger.record(stolen).duplicate
    assert not ledger.record(own, samples=_ids(A, 0, 2)).duplicate  # judged on its own, not a resend
    assert (
        ledger.verdict_for(own.document.file_hash, A) == own
        and ledger.verdict_for(own.document.file_hash, B) == stolen
    )
    assert ledger.verdicts_for(own.document.file_hash) == [stolen, own]
    assert _totals(ledger, A)[2] == 1.0 and ledger.history(B).banned


def test_a_version_2_ledger_is_rebuilt_keyed_by_file_and_sender(tmp_path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.execute(CREATE_MIGRATIONS_TABLE)
    for migration in MIGRATIONS[:2]:
        for statement in migration.statements:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO schema_migrations VALUES (?, ?, ?)", (migration.version, migration.name, T0)
        )
    old = signed_verdict(A, accepted=False, failed_check="toploc", at=T0)
    conn.execute(
        "INSERT INTO nodes (node_id, first_seen, last_seen, score) VALUES (?, ?, ?, -100)", (A, T0, T0)
    )
    conn.execute(
        "INSERT INTO contributions VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,NULL)",
        (
            old.document.file_hash,
            A,
            3,
            0,
            0,
            0,
            "toploc",
            "x",
            VALIDATOR.node_id,
            T0,
            T0,
            T0,
            old.to_json().decode(),
        ),
    )
    conn.execute(
        "INSERT INTO slashes (node_id, file_hash, amount, check_class, failed_check, reason, created_at)"
        " VALUES (?, ?, 100, 'fraud', 'toploc', 'x', ?)",
        (A, old.document.file_hash, T0),
    )
    conn.execute(
        "INSERT INTO bans (node_id, file_hash, reason, created_at, until) VALUES (?, ?, 'fraud', ?, ?)",
        (A, old.document.file_hash, T0, T0 + 60),
    )
    conn.execute(
        "INSERT INTO bans (node_id, file_hash, reason, created_at, until) VALUES (?, NULL, 'manual', ?, NULL)",
        (A, T0),
    )
    conn.commit()
    conn.close()
    with Ledger(path) as ledger:
        assert ledger.schema_version() == LATEST_VERSION
        assert ledger.verdict_for(old.document.file_hash, A) == old  # old records stay readable
        assert [b.reason for b in ledger.active_bans(now=T0 + 1)] == ["fraud", "manual"]
        assert ledger.query("SELECT COUNT(*) FROM slashes")[0][0] == 1
        assert (
            ledger.query("PRAGMA foreign_key_check") == [] and ledger.query("PRAGMA foreign_keys")[0][0] == 1
        )
        # The same bytes from another sender now get their own row.
        ledger.record(signed_verdict(B, file_hash=old.document.file_hash, samples=2), samples=_ids(B, 0, 2))
        assert len(ledger.verdicts_for(old.document.file_hash)) == 2


def test_a_version_3_ledgers_accepted_files_keep_no_share_and_count_whole(tmp_path):
    # Files accepted before version 4 were credited 1 each: they keep NULL in credit_share, and everything that
    # weights by the share (the ranking, the totals, the validator's standing) counts them whole.
    from prime_node.trainer.ledger.activity import totals
    from prime_node.trainer.ledger.leaderboard import leaderboard

    path = tmp_path / "v3.sqlite"
    conn = sqlite3.connect(path)
    conn.execute(CREATE_MIGRATIONS_TABLE)
    for migration in MIGRATIONS[:3]:
        for statement in migration.statements:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO schema_migrations VALUES (?, ?, ?)", (migration.version, migration.name, T0)
        )
    old = signed_verdict(A, tokens=120, samples=3, at=T0)
    conn.execute(
        "INSERT INTO nodes (node_id, first_seen, last_seen, score) VALUES (?, ?, ?, 1.0)", (A, T0, T0)
    )
    conn.execute(
        "INSERT INTO contributions VALUES (?,?,?,?,?,?,NULL,?,?,?,?,?,?,NULL)",
        (old.document.file_hash, A, 3, 3, 120, 1, "", VALIDATOR.node_id, T0, T0, T0, old.to_json().decode()),
    )
    conn.commit()
    conn.close()
    with Ledger(path) as ledger:
        assert ledger.schema_version() == LATEST_VERSION == 4
        share = ledger.query("SELECT credit_share FROM contributions WHERE node_id = ?", (A,))
        assert [r["credit_share"] for r in share] == [None]
        ledger.record(signed_verdict(B, tokens=120, samples=4, at=T0 + 1), credit_share=0.5)
        rows = {r.node_id: r for r in leaderboard(ledger, now=T0 + 2)}
        assert (rows[A].accepted_tokens, rows[A].accepted_samples, rows[A].score) == (120, 3, 1.0)
        assert (rows[B].accepted_tokens, rows[B].accepted_samples, rows[B].score) == (60, 2, 0.5)
        assert (totals(ledger).accepted_tokens, totals(ledger).accepted_samples) == (180, 5)
