"""Batch assembly: async window, grouping and filtering, and the crash-safe record of consumed rollouts."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prime_node.trainer.errors import TrainerError
from prime_node.trainer.service.batch_buffer import BatchBuffer, RolloutRecord, RolloutSample
from prime_node.trainer.service.consumed import ConsumedLedger


def _record(file_id: str, step: int, rewards_by_prompt: dict[str, list[float]]) -> RolloutRecord:
    samples = []
    for key, rewards in rewards_by_prompt.items():
        for j, r in enumerate(rewards):
            samples.append(RolloutSample(key, (5, 6, 7), (10 + j, 1), task_reward=r))
    # interleave prompts so grouping by key is really exercised
    samples.sort(key=lambda s: s.completion_ids)
    return RolloutRecord(file_id=file_id, policy_step=step, samples=tuple(samples))


@pytest.fixture
def ledger(tmp_path: Path):
    with ConsumedLedger(tmp_path / "consumed.sqlite") as db:
        yield db


def test_groups_by_prompt_scores_and_filters(ledger: ConsumedLedger) -> None:
    buf = BatchBuffer(ledger, batch_size=4, async_level=2)
    report = buf.add(_record("f1", 3, {"a": [1, 0], "b": [1, 1], "c": [0, 0.5, 1]}), current_step=3)
    assert (report.kept, report.filtered, report.stale) == (2, 1, 0)
    assert ledger.state(("f1", "b")) == "dropped" and ledger.state(("f1", "a")) is None
    batch = buf.take(current_step=3)
    assert batch is not None and batch.num_samples == 5
    by_key = {g.prompt_key: g.stats.advantages for g in batch.groups}
    assert by_key["a"] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert by_key["c"] == pytest.approx([-1.2247, 0.0, 1.2247], abs=1e-4)  # +-0.5 / sqrt(1/6)
    assert sorted(t.advantage for t in batch.train_samples()) == pytest.approx(
        sorted(by_key["a"] + by_key["c"])
    )


def test_async_window(ledger: ConsumedLedger) -> None:
    buf = BatchBuffer(ledger, batch_size=3, async_level=2)
    assert (
        buf.add(_record("old", 2, {"p": [0, 1]}), current_step=5).stale == 1
    )  # 5 - 2 = 3 is the oldest usable
    assert buf.add(_record("edge", 3, {"p": [0, 1]}), current_step=5).kept == 1
    assert buf.add(_record("new", 5, {"p": [1, 0]}), current_step=5).kept == 1
    with pytest.raises(TrainerError, match="newer than the trainer"):
        buf.add(_record("future", 6, {"p": [0, 1]}), current_step=5)
    # by step 6 the step-3 group has aged out of the window: evicted and recorded, not trained on
    batch = buf.take(current_step=6)
    assert batch is None and buf.buffered_samples == 2
    assert ledger.state(("edge", "p")) == "dropped" and ledger.state(("old", "p")) == "dropped"
    buf.add(_record("newer", 6, {"q": [0, 1]}), current_step=6)
    batch = buf.take(current_step=6)
    assert [g.file_id for g in batch.groups] == ["new", "newer"] and batch.num_samples == 4  # whole groups
    metrics = batch.reward_metrics()
    assert metrics["task_reward"] == 0.5 and metrics["policy_lag"] == 0.5 and metrics["groups"] == 2
    assert buf.buffered_samples == 0


def test_oldest_usable_policy_goes_first(ledger: ConsumedLedger) -> None:
    buf = BatchBuffer(ledger, batch_size=2, async_level=2)
    buf.add(_record("fresh", 6, {"p": [0, 1]}), current_step=6)
    buf.add(_record("older", 4, {"p": [0, 1]}), current_step=6)  # arrives later, expires sooner
    assert [g.file_id for g in buf.take(current_step=6).groups] == ["older"]


def test_async_level_zero_is_on_policy(ledger: ConsumedLedger) -> None:
    buf = BatchBuffer(ledger, batch_size=2, async_level=0)
    assert buf.add(_record("lag", 4, {"p": [0, 1]}), current_step=5).stale == 1
    assert buf.add(_record("now", 5, {"p": [0, 1]}), current_step=5).kept == 1


def test_waits_for_a_full_batch_and_never_hands_out_a_group_twice(ledger: ConsumedLedger) -> None:
    buf = BatchBuffer(ledger, batch_size=6, async_level=2)
    buf.add(_record("f1", 0, {"a": [0, 1], "b": [1, 0]}), current_step=0)
    assert buf.take(current_step=0) is None
    assert buf.add(_record("f1", 0, {"a": [0, 1]}), current_step=0).already_known == 1  # re-offered file
    buf.add(_record("f2", 0, {"a": [0, 1, 1]}), current_step=0)
    batch = buf.take(current_step=0)
    assert batch.num_samples == 7 and ledger.counts()["reserved"] == 3
    assert buf.add(_record("f2", 0, {"a": [0, 1, 1]}), current_step=0).already_known == 1
    with pytest.raises(TrainerError, match="twice"):
        ledger.reserve(1, [("f1", "a")])


def test_release_returns_groups_and_capacity_defers(ledger: ConsumedLedger) -> None:
    buf = BatchBuffer(ledger, batch_size=2, async_level=1, max_buffered_samples=4)
    buf.add(_record("f1", 0, {"a": [0, 1], "b": [0, 1]}), current_step=0)
    assert not buf.add(_record("f2", 0, {"c": [0, 1]}), current_step=0).accepted  # full: keep the file
    batch = buf.take(current_step=0)
    buf.release(batch)
    assert ledger.counts()["reserved"] == 0 and buf.buffered_samples == 4
    again = buf.take(current_step=0)
    assert [g.key for g in again.groups] == [g.key for g in batch.groups]


def _restart(path: Path, resume_step: int) -> tuple[list[str], int]:
    """A restarted trainer: settle reservations, re-read the file; (available prompt keys, already known)."""
    with ConsumedLedger(path) as db:
        db.recover(resume_step)
        buf = BatchBuffer(db, batch_size=2, async_level=2)
        report = buf.add(_record("f1", 0, {"a": [0, 1], "b": [1, 0]}), current_step=resume_step)
        return [key for _, key in buf.pending_keys()], report.already_known


def test_crash_before_checkpoint_releases_after_checkpoint_consumes(tmp_path: Path) -> None:
    path = tmp_path / "consumed.sqlite"
    with ConsumedLedger(path) as db:
        buf = BatchBuffer(db, batch_size=2, async_level=2)
        buf.add(_record("f1", 0, {"a": [0, 1], "b": [1, 0]}), current_step=0)
        batch = buf.take(current_step=0)  # reserves one group for step 0, then "crash": no commit
    assert len(batch.groups) == 1
    # checkpoint 1 was never written: resume at 0, the reserved group is available again (not lost)
    keys, known = _restart(path, resume_step=0)
    assert sorted(keys) == ["a", "b"] and known == 0
    with ConsumedLedger(path) as db:
        db.reserve(
            0, [("f1", "a")]
        )  # trained again on step 0, then crashed after checkpoint 1, before commit
    # checkpoint 1 was written but the commit was not: resume at 1, the group counts as consumed (not twice)
    keys, known = _restart(path, resume_step=1)
    assert keys == ["b"] and known == 1
    with ConsumedLedger(path) as db:
        assert db.counts() == {"reserved": 0, "consumed": 1, "dropped": 0}


def test_commit_survives_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "consumed.sqlite"
    child = textwrap.dedent(
        f"""
        import os, signal
        from prime_node.trainer.service.consumed import ConsumedLedger
        db = ConsumedLedger({str(path)!r})
        db.reserve(7, [("file-a", "p0"), ("file-a", "p1")])
        db.commit(7)
        db.reserve(8, [("file-b", "p0")])
        os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: as a crash
        """
    )
    proc = subprocess.run([sys.executable, "-c", child], timeout=120, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    with ConsumedLedger(path) as db:
        assert db.state(("file-a", "p0")) == "consumed" and db.state(("file-b", "p0")) == "reserved"
        assert db.recover(resume_step=8) == (0, 1)  # checkpoint 9 never existed: step 8's group is released
        assert (
            db.known("file-a") == {"p0": "consumed", "p1": "consumed"} and db.state(("file-b", "p0")) is None
        )
    assert os.path.getsize(path) > 0


def test_corrupt_record_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "consumed.sqlite"
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(TrainerError, match="unreadable"):
        ConsumedLedger(path)


def _copy(file_id: str, step: int, rewards_by_prompt: dict[str, list[float]]) -> RolloutRecord:
    """A record whose samples carry identities that depend on prompt and position only, not on the file: two
    copies of the same work under two file ids (as two validators' copies in two encodings would be)."""
    record = _record(file_id, step, rewards_by_prompt)
    samples = tuple(
        dataclasses.replace(s, sample_id=f"work/{s.prompt_key}/{s.completion_ids[0]}") for s in record.samples
    )
    return dataclasses.replace(record, samples=samples)


def test_a_sample_is_used_once_whichever_file_carries_it(tmp_path: Path) -> None:
    path = tmp_path / "consumed.sqlite"
    with ConsumedLedger(path) as db:
        buf = BatchBuffer(db, batch_size=2, async_level=2)
        first = buf.add(_copy("enc-1", 0, {"a": [0, 1], "b": [1, 0], "z": [1, 1]}), current_step=0)
        assert (first.kept, first.filtered) == (2, 1)
        # Buffered (a, b), dropped for zero advantage (z): the copy brings nothing new.
        assert (
            buf.add(_copy("enc-2", 0, {"a": [0, 1], "b": [1, 0], "z": [1, 1]}), current_step=0).already_known
            == 3
        )
        batch = buf.take(current_step=0)
        assert [g.file_id for g in batch.groups] == ["enc-1"]
        # Reserved (in a batch) or buffered: a third copy, with one new prompt, brings only that prompt.
        third = buf.add(_copy("enc-3", 0, {"a": [0, 1], "b": [1, 0], "c": [0, 1]}), current_step=0)
        assert (third.kept, third.already_known) == (1, 2)
        with pytest.raises(TrainerError, match="twice"):  # the record's key refuses a sample reserved twice
            db.reserve(1, [("enc-2", "a")], [("work/a/10", ("enc-2", "a"))])
        buf.release(batch)  # training failed: the group is back, its samples still taken by it
        assert buf.add(_copy("enc-4", 0, {"a": [0, 1]}), current_step=0).already_known == 1
        batch = buf.take(current_step=0)
        buf.commit(batch)
        consumed = [s.sample_id for g in batch.groups for s in g.samples]
        assert db.seen_samples([*consumed, "work/q/10"]) == set(consumed)
        pending = buf.take(current_step=0)  # reserved for step 0, then a crash before checkpoint 1
        assert pending is not None
    with ConsumedLedger(path) as db:
        assert db.recover(resume_step=0) == (0, len(pending.groups))  # released: their samples are free again
        buf = BatchBuffer(db, batch_size=2, async_level=2)
        again = buf.add(
            _copy("enc-5", 0, {"a": [0, 1], "b": [1, 0], "c": [0, 1], "z": [1, 1]}), current_step=0
        )
        # a: consumed; z: dropped; b: released by the crash; c: was only buffered, never recorded.
        assert [g.prompt_key for g in pending.groups] == ["b"]
        assert (again.kept, again.already_known) == (2, 2) and sorted(k for _, k in buf.pending_keys()) == [
            "b",
            "c",
        ]


def test_a_version_1_record_is_upgraded_and_keeps_what_it_recorded(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "consumed.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE groups (file_id TEXT NOT NULL, group_key TEXT NOT NULL, state TEXT NOT NULL, step INTEGER NOT "
        "NULL, reason TEXT NOT NULL DEFAULT '', PRIMARY KEY (file_id, group_key));"
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES ('schema', '1'); INSERT INTO groups VALUES ('old', 'a', 'consumed', 3, '');"
    )
    conn.commit()
    conn.close()
    with ConsumedLedger(path) as db:
        assert db.state(("old", "a")) == "consumed"
        buf = BatchBuffer(db, batch_size=2, async_level=2)
        assert buf.add(_copy("old", 3, {"a": [0, 1], "b": [1, 0]}), current_step=3).already_known == 1
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == ("2",)
