"""The durable rollout outbox and the async-window checkpoint choice."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

import pytest

from prime_node.node.contributor.outbox import Outbox, OutboxError
from prime_node.node.contributor.policy_window import steps_to_delete, usable_step


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
        from prime_node.node.contributor.outbox import Outbox
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


async def test_unsent_files_outside_the_async_window_are_dropped_not_sent(tmp_path):
    import asyncio

    from prime_node.node.contributor.delivery import Delivery
    from prime_node.node.contributor.state import NodeState
    from prime_node.p2p.identity import Identity
    from prime_node.p2p.swarm import RolloutEnvelope, SwarmError

    box, node = Outbox(tmp_path), Identity.generate()
    by_step = {}
    for step in (1, 3, 5):
        payload = f"rows of step {step}".encode()
        sha, f, s = _stage(box, payload)
        s.write_text(RolloutEnvelope.sign(node, payload, (step, 0)).model_dump_json())
        by_step[step] = box.commit(sha, f, s, policy_step=step)
    assert sorted(e.policy_step for e in box.pending_entries()) == [1, 3, 5]
    assert Outbox(tmp_path).pending_entries()[0].policy_step is not None  # the step survives a restart

    asked: list[str] = []

    class NoValidatorYet:  # the transport: records what it was asked to route and fails like an absent validator
        async def route(self, envelope):
            asked.append(envelope.sha256)
            raise SwarmError("no validator announced yet")

    state = NodeState(node.node_id, None)
    state.set_announced(5)
    delivery = Delivery(NoValidatorYet(), box, state, retry_s=30.0, max_retry_s=30.0, async_level=2)
    task = asyncio.create_task(delivery.run())
    for _ in range(200):  # bounded: the first pass drops, then tries the oldest usable file
        if asked:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert asked == [by_step[3].sha256]  # step 1 < 5 - 2 was never offered to the validator
    assert sorted(e.policy_step for e in box.pending_entries()) == [3, 5]
    assert not by_step[1].file_path.exists() and not by_step[1].step_path.exists()
    assert state.rollouts.stale == 1
