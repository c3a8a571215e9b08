"""The durable rollout outbox and the async-window checkpoint choice."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from prime_node.node.daemon.outbox import Outbox, OutboxError
from prime_node.node.daemon.policy_window import steps_to_delete, usable_step


def _stage(outbox: Outbox, payload: bytes):
    sha = hashlib.sha256(payload).hexdigest()
    f = outbox.staging_path(f"{sha}.parquet")
    f.write_bytes(payload)
    s = outbox.staging_path(f"{sha}.sig")
    s.write_bytes(b"sig")
    return sha, f, s


def test_commit_pending_acknowledge_cycle(tmp_path):
    box = Outbox(tmp_path)
    sha, f, s = _stage(box, b"rows")
    entry = box.commit(sha, f, s)
    assert [e.sha256 for e in box.pending_entries()] == [sha]
    assert entry.file_path.read_bytes() == b"rows" and not f.exists()
    box.acknowledge(entry, {"sha256": sha, "time": 1.0})
    assert box.pending_entries() == [] and box.counts() == {"pending": 0, "sent": 1}
    assert box.receipts() == [{"sha256": sha, "time": 1.0}]
    box.acknowledge(entry, {"sha256": sha, "time": 1.0})  # idempotent
    assert box.counts() == {"pending": 0, "sent": 1}


def test_rejects_bad_hash_names(tmp_path):
    box = Outbox(tmp_path)
    _, f, s = _stage(box, b"x")
    with pytest.raises(OutboxError):
        box.commit("../../etc/passwd", f, s)


def test_survives_sigkill_between_writes(tmp_path):
    """A process killed after staging but before committing leaves nothing visible; a committed entry stays."""
    script = textwrap.dedent(
        f"""
        import hashlib, os, signal
        from prime_node.node.daemon.outbox import Outbox
        box = Outbox({str(tmp_path)!r})
        done = b"complete"
        sha = hashlib.sha256(done).hexdigest()
        f = box.staging_path(sha + ".parquet"); f.write_bytes(done)
        s = box.staging_path(sha + ".sig"); s.write_bytes(b"sig")
        box.commit(sha, f, s)
        half = box.staging_path("f" * 64 + ".parquet"); half.write_bytes(b"half")
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert result.returncode == -9
    box = Outbox(tmp_path)  # the restart
    assert [e.sha256 for e in box.pending_entries()] == [hashlib.sha256(b"complete").hexdigest()]
    assert list(box.tmp.iterdir()) == []


def test_entry_without_signature_is_discarded(tmp_path):
    box = Outbox(tmp_path)
    (box.pending / ("a" * 64 + ".parquet")).write_bytes(b"x")
    assert box.pending_entries() == []
    assert not (box.pending / ("a" * 64 + ".parquet")).exists()


def test_async_window():
    assert usable_step(None, [0, 1], 2) is None
    assert usable_step(5, [1, 2, 3, 4], 2) == 4
    assert usable_step(5, [1, 2], 2) is None  # too old: wait for a newer checkpoint
    assert usable_step(5, [3], 2) == 3  # exactly at the edge of the window
    assert usable_step(5, [6, 3], 2) == 3  # never ahead of the announcement
    assert steps_to_delete([1, 2, 3, 4, 5], 5, 2) == [1, 2]
    assert steps_to_delete([1, 2], None, 2) == []
