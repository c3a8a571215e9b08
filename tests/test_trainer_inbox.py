"""The trainer's inbox: only complete, correctly signed files of this run reach the batch buffer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from prime_node.proofs.rollout_file import read_rollout_file
from prime_node.trainer.service.batch_buffer import BatchBuffer
from prime_node.trainer.service.consumed import ConsumedLedger
from prime_node.trainer.service.inbox import Inbox

from support.attack import make_checkpoint
from support.trainer_service import RUN_ID, deliver, make_accepted_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("inbox")
    return make_accepted_files(make_checkpoint(root / "ckpt"), 0, 3, root / "stage")


def _copy(src: Path, dst_dir: Path) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    for suffix in ("", ".sig"):
        Path(f"{dst_dir / src.name}{suffix}").write_bytes(Path(f"{src}{suffix}").read_bytes())
    return dst_dir / src.name


def test_inbox_reads_verified_files_oldest_first_and_groups_by_prompt(staged, tmp_path):
    inbox_dir = tmp_path / "accepted"
    shas = []
    for i, path in enumerate(staged):
        sha = deliver(_copy(path, tmp_path / "copy"), inbox_dir)
        os.utime(inbox_dir / f"{sha}.parquet", ns=(10**18 + i, 10**18 + i))  # arrival order, not name order
        shas.append(sha)
    (inbox_dir / f"{'0' * 64}.parquet").write_bytes(b"no signature yet")  # still being delivered: not offered
    inbox = Inbox(inbox_dir, RUN_ID)
    pending = inbox.pending()
    assert [p.name for p in pending] == [f"{s}.parquet" for s in shas]
    record = inbox.read(pending[0])
    assert record is not None and record.file_id == shas[0] and record.policy_step == 0
    rows = read_rollout_file(pending[0]).rows
    assert [s.prompt_key for s in record.samples] == [str(r.sample_index) for r in rows]
    assert [s.completion_ids for s in record.samples] == [r.output_ids for r in rows]
    with ConsumedLedger(tmp_path / "consumed.sqlite") as ledger:
        buffer = BatchBuffer(ledger, batch_size=6, async_level=2)
        report = buffer.add(record, 0)
        assert report.accepted and report.kept + report.filtered == 2
    inbox.mark_done(pending[0])
    assert [p.name for p in inbox.pending()] == [f"{s}.parquet" for s in shas[1:]]


def test_inbox_skips_tampered_unsigned_and_foreign_files(staged, tmp_path, caplog):
    inbox_dir = tmp_path / "accepted"
    tampered = _copy(staged[0], inbox_dir)
    data = bytearray(tampered.read_bytes())
    data[len(data) // 2] ^= 0x01
    tampered.write_bytes(bytes(data))
    forged = _copy(staged[1], inbox_dir)
    envelope = json.loads(Path(f"{forged}.sig").read_text())
    envelope["node_id"] = "ab" * 32  # claims another signer
    Path(f"{forged}.sig").write_text(json.dumps(envelope))
    foreign = _copy(staged[2], inbox_dir)
    inbox = Inbox(inbox_dir, "another-run")
    assert inbox.read(foreign) is None  # a correctly signed file of another run is not this trainer's data
    # Nor is one sampled at another temperature than the trainer's log-probabilities assume.
    assert Inbox(inbox_dir, RUN_ID, temperature=0.7).read(foreign) is None
    assert "sampled at temperature 1.0, the run's is 0.7 (run.temperature): the validator" in caplog.text
    inbox = Inbox(inbox_dir, RUN_ID)
    assert inbox.read(tampered) is None
    assert inbox.read(forged) is None
    assert inbox.read(foreign) is not None
    assert {p.name for p in inbox.pending()} == {foreign.name}  # refused files are not offered again
    assert "signed SHA-256" in caplog.text or "signature" in caplog.text
