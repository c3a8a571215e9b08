"""What a StageHost hands in and which batch numbers it signs, with two hosts in one process (LoopbackHops):
batch numbers never repeat for a group across a restart (BatchMarks, durable); a receiver that finds a frame
its commitment belies hands in the evidence that blames its sender; a batch broken by a dropped row has every
member hand in its partial record, from which blame_broken names the stage that dropped it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoConfig

from prime_node.node.contributor.outbox import Outbox
from prime_node.node.contributor.pipeline_stage import PipelineStage
from prime_node.node.contributor.settings import PipelineNodeSettings, StartSettings
from prime_node.node.contributor.state import NodeState
from prime_node.node.engine.hf import eos_and_pad
from prime_node.node.engine.types import SamplingParams
from prime_node.node.pipeline.batch_marks import (
    FORMAT,
    FORMAT_V2,
    FORMAT_V3,
    MAX_FILE_BYTES,
    MAX_MARKS,
    MAX_RUN_ID,
    BatchMarks,
)
from prime_node.node.pipeline.broken_files import BrokenFileBudget
from prime_node.node.pipeline.driver import Tamper
from prime_node.node.pipeline.errors import PipelineError
from prime_node.node.pipeline.group import HopSettings
from prime_node.node.pipeline.hops import LoopbackHops
from prime_node.node.pipeline.host import BatchDone, BatchLost, StageHost
from prime_node.node.pipeline.stage import Outgoing
from prime_node.node.pipeline.stage_model import StageModel
from prime_node.node.pipeline.work import PipelineWork
from prime_node.node.run.settings import RunSettings
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.frames import FrameWriter
from prime_node.p2p.pipeline.group_ids import nonce_formed_ms
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.pipeline.transport import Route
from prime_node.p2p.swarm.group_records import GroupRecord, group_id
from prime_node.p2p.wire import MAX_UNIX_TIME
from prime_node.proofs.pipeline.blame import GroupWork, check_fraud
from prime_node.proofs.pipeline.broken import BatchRules, blame_broken, cut_of
from prime_node.proofs.pipeline.records import GroupSpec

from support.nonces import NONCE, formed_at_of, nonce_at
from support.pipeline import random_requests, save_tiny
from support.pipeline_files import drop_a_row, uncommitted

RUN = "host-batches"
LAYOUT = StageLayout(boundaries=[0, 2, 4])
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)
SAMPLES, MICRO = 4, 2
HOP = HopSettings(frame_timeout_s=10.0, connect_timeout_s=10.0)
IDS = [Identity.from_seed(bytes([k + 1]) * 32) for k in range(2)]
FORMED = nonce_formed_ms(NONCE)  # the test group's formation time (ms), as its nonce carries it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-host-batches"))


def _group() -> GroupRecord:
    """The test's group: the same id on every call (its nonce is fixed)."""
    members = [i.node_id for i in IDS]
    return GroupRecord(
        group_id=group_id(RUN, 0, members, LAYOUT, NONCE),
        round=1,
        policy_step=0,
        layout=LAYOUT,
        members=members,
        formed_at=formed_at_of(NONCE),
        signed_at=time.time(),
        nonce=NONCE,
    )


def _work(model_dir: Path) -> Callable[[GroupRecord, int], PipelineWork]:
    eos, pad = eos_and_pad(AutoConfig.from_pretrained(model_dir, local_files_only=True))

    def work_for(group: GroupRecord, batch: int) -> PipelineWork:
        seed = int.from_bytes(hashlib.sha256(f"{group.group_id}|{batch}".encode()).digest()[:8], "big")
        return PipelineWork(random_requests(SAMPLES, seed), PARAMS, MICRO, eos, pad)

    return work_for


async def _run(
    model_dir: Path,
    marks: list[BatchMarks],
    until: Callable[[list[BatchDone], list[BatchLost]], bool],
    tamper: Tamper | None = None,
    timeout_s: float = 60.0,
    host_type: type[StageHost] = StageHost,
    work_for: Callable[[GroupRecord, int], PipelineWork] | None = None,
) -> tuple[list[BatchDone], list[BatchLost]]:
    """Both stages of the group, as hosts of this process, until `until(done, lost)` (bounded)."""
    done: list[BatchDone] = []
    lost: list[BatchLost] = []

    async def on_batch(result: BatchDone) -> None:
        done.append(result)

    async def on_lost(result: BatchLost) -> None:
        lost.append(result)

    hops, work_for = LoopbackHops(), work_for or _work(model_dir)
    hosts = [
        host_type(
            IDS[k], RUN, model_dir, LAYOUT, work_for, hops, HOP, on_batch,
            on_lost=on_lost, marks=marks[k], tamper=tamper, retry_s=0.05,
        )
        for k in range(2)
    ]  # fmt: skip
    try:
        for host in hosts:
            await host.on_change(_group(), "named by the test's group")
        deadline = time.monotonic() + timeout_s
        while not until(done, lost):
            assert time.monotonic() < deadline, (
                f"not met in {timeout_s} s: {len(done)} done, {len(lost)} lost"
            )
            for host in hosts:
                assert host.task is not None and not host.task.done(), "a stage task ended"
            await asyncio.sleep(0.05)
    finally:
        for host in hosts:
            await host.stop()
    return done, lost


def _per_stage(done: list[BatchDone], stage: int) -> list[int]:
    return [d.batch for d in done if d.stage == stage]


def _enough(count: int) -> Callable[[list[BatchDone], list[BatchLost]], bool]:
    return lambda done, _: all(len(_per_stage(done, k)) >= count for k in range(2))


async def test_batch_numbers_never_repeat_for_a_group_across_a_restart(
    model_dir: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    paths = [tmp_path / f"node-{k}" / "batch_marks.json" for k in range(2)]
    first, _ = await _run(model_dir, [BatchMarks(p) for p in paths], _enough(2))
    # A restart of both nodes: the stage tasks start again, with the marks read back from disk.
    second, _ = await _run(model_dir, [BatchMarks(p) for p in paths], _enough(1))
    gid = _group().group_id
    for k in range(2):
        before, after = _per_stage(first, k), _per_stage(second, k)
        assert min(after) > max(before), (k, before, after)
        assert BatchMarks(paths[k]).next_batch(RUN, gid, 0, formed_ms=FORMED) > max(after)
    signed = [(d.stage, d.batch) for d in first + second]
    assert len(signed) == len(set(signed))


def test_batch_marks_are_durable_and_refuse_reuse(tmp_path: Path) -> None:
    path = tmp_path / "marks.json"
    marks = BatchMarks(path)
    marks.use(RUN, "aa" * 32, 3, 0, formed_ms=FORMED)
    marks.use(RUN, "aa" * 32, 3, 5, formed_ms=FORMED)
    assert BatchMarks(path).next_batch(RUN, "aa" * 32, 3, formed_ms=FORMED) == 6
    with pytest.raises(PipelineError, match="already used"):
        marks.use(RUN, "aa" * 32, 3, 3, formed_ms=FORMED)
    with pytest.raises(PipelineError, match="a group id names one step"):
        marks.use(RUN, "aa" * 32, 4, 6, formed_ms=FORMED)
    for text, why in (
        ("{", "unreadable"),
        (json.dumps({"format": "other", "next": []}), "format"),
        (json.dumps({"format": FORMAT_V2, "floor": 0, "next": [["aa", 0, -1]]}), "batch number"),
        (json.dumps({"format": FORMAT_V2, "floor": 0, "next": [["aa", -2, 1]]}), "a step"),
        (json.dumps({"format": FORMAT_V2, "floor": 0, "next": [["aa", 1]]}), "unreadable"),
        (json.dumps({"format": FORMAT_V2, "floor": -1, "next": []}), "floor"),
        (json.dumps({"format": FORMAT_V2, "floor": 0, "next": [["aa", True, 1]]}), "a step"),
        (
            json.dumps({"format": FORMAT_V3, "runs": [["r", 0, [["aa", None, 1]]]], "legacy": {}}),
            "names no step",
        ),
        (
            json.dumps({"format": FORMAT, "runs": [["r", 0, 0, [["aa", None, 1, 5]]]], "legacy": {}}),
            "names no step",
        ),
        (
            json.dumps({"format": FORMAT, "runs": [["r", 0, 0, [["aa", 1, 1, -5]]]], "legacy": {}}),
            "formation",
        ),
        (
            json.dumps({"format": FORMAT, "runs": [["r", 0, 0, [["aa", 1, 1, 1.5]]]], "legacy": {}}),
            "formation",
        ),
        (json.dumps({"format": FORMAT, "runs": [["r", 0, 0, [["aa", 1, 1]]]], "legacy": {}}), "unreadable"),
        (json.dumps({"format": FORMAT, "runs": [["r", 0, []]], "legacy": {}}), "unreadable"),  # a v3 entry
        (
            json.dumps({"format": FORMAT, "runs": [["r", 0, 0, []], ["r", 0, 0, []]], "legacy": {}}),
            "named twice",
        ),
        (json.dumps({"format": FORMAT, "runs": [["", 0, 0, []]], "legacy": {}}), "run id"),
        (json.dumps({"format": FORMAT, "runs": [["r", -1, 0, []]], "legacy": {}}), "floor"),
        (json.dumps({"format": FORMAT, "runs": [["r", 0, -1, []]], "legacy": {}}), "floor"),
        (json.dumps({"format": FORMAT, "runs": [["r", 0, True, []]], "legacy": {}}), "floor"),
        (json.dumps({"format": FORMAT, "runs": []}), "legacy"),
        (json.dumps([]), "not a JSON object"),
    ):
        path.write_text(text)
        with pytest.raises(PipelineError, match=why):
            BatchMarks(path)


def _marks_in(path: Path) -> list[list[object]]:
    document = json.loads(path.read_text())
    return [m for _, _, _, marks in document["runs"] for m in marks] + document["legacy"]["next"]


def test_each_run_keeps_its_own_floor_across_a_reload(tmp_path: Path) -> None:
    """One floor for every run refused a node's groups of a new run (same data directory) below the old run's
    newest step minus `keep_steps`: run B's step 3 after run A's step 500. Each run now has its own floor."""
    path = tmp_path / "marks.json"
    marks = BatchMarks(path, keep_steps=128)
    marks.use("run-a", "aa" * 32, 500, 0, formed_ms=FORMED)
    for reread in (marks, BatchMarks(path, keep_steps=128)):
        assert reread.floor("run-a") == 372 and reread.floor("run-b") == 0
        assert reread.why_refused("run-b", "bb" * 32, 3, formed_ms=FORMED) is None
        assert "below 372" in (reread.why_refused("run-a", "cc" * 32, 3, formed_ms=FORMED) or "")
    reread = BatchMarks(path, keep_steps=128)
    reread.use("run-b", "bb" * 32, 3, 0, formed_ms=FORMED)
    again = BatchMarks(path, keep_steps=128)
    assert (
        again.next_batch("run-b", "bb" * 32, 3, formed_ms=FORMED) == 1
        and again.next_batch("run-a", "aa" * 32, 500, formed_ms=FORMED) == 1
    )
    assert again.floor("run-a") == 372 and again.floor("run-b") == 0


def test_a_v2_file_of_an_unknown_run_is_read_safely(tmp_path: Path) -> None:
    """A v2 file kept one floor and no run id: its marks still count for the group that uses them (numbers never
    repeat), and its floor for every run (nothing says which run raised it), across a rewrite in the v3 format."""
    path = tmp_path / "marks.json"
    path.write_text(json.dumps({"format": FORMAT_V2, "floor": 40, "next": [["aa" * 32, 50, 7]]}))
    marks = BatchMarks(path)
    assert marks.next_batch("any", "aa" * 32, 50, formed_ms=FORMED) == 7 and "below 40" in (
        marks.why_refused("new", "bb" * 32, 39, formed_ms=FORMED) or ""
    )
    with pytest.raises(PipelineError, match="already used"):
        marks.use("run-a", "aa" * 32, 50, 6, formed_ms=FORMED)
    marks.use("run-a", "aa" * 32, 50, 7, formed_ms=FORMED)  # the mark moves to the run that used it
    reread = BatchMarks(path)
    assert json.loads(path.read_text())["format"] == FORMAT
    assert reread.next_batch("run-a", "aa" * 32, 50, formed_ms=FORMED) == 8 and reread.floor("run-b") == 40


def test_a_mark_is_never_forgotten_while_its_group_could_run_again(tmp_path: Path) -> None:
    """The file kept the 1024 most recently used groups: the 1025th pushed out the first, whose batch numbers
    then began again at 0 (openings signed twice). Marks are now dropped only by step: those of steps more than
    `keep_steps` below the newest, with every group below that floor refused for good, across a restart too."""
    path = tmp_path / "marks.json"
    first = f"{0:064x}"
    # 1100 groups of one step, the first used first (written directly: 1100 fsynced saves take seconds).
    many = [[first, 10, 8, FORMED]] + [[f"{k:064x}", 10, 1, FORMED] for k in range(1, 1100)]
    path.write_text(
        json.dumps({"format": FORMAT, "runs": [[RUN, 0, 0, many]], "legacy": {"floor": 0, "next": []}})
    )
    marks = BatchMarks(path, keep_steps=4)
    marks.use(
        RUN, "ab" * 32, 10, 0, formed_ms=FORMED
    )  # one more group of the same step: none may push the first out
    assert BatchMarks(path, keep_steps=4).next_batch(RUN, first, 10, formed_ms=FORMED) == 8
    assert len(_marks_in(path)) == 1101
    marks.use(RUN, "bb" * 32, 14, 0, formed_ms=FORMED)  # 14 - 4 = 10: step 10 is still kept
    assert BatchMarks(path, keep_steps=4).next_batch(RUN, first, 10, formed_ms=FORMED) == 8
    marks.use(
        RUN, "cc" * 32, 15, 2, formed_ms=FORMED
    )  # step 10 falls below the floor (11): its marks go, its groups are refused
    for reread in (marks, BatchMarks(path, keep_steps=4)):
        assert reread.floor(RUN) == 11
        assert "below 11" in (reread.why_refused(RUN, first, 10, formed_ms=FORMED) or "")
        with pytest.raises(PipelineError, match="refused"):
            reread.next_batch(RUN, first, 10, formed_ms=FORMED)
        with pytest.raises(PipelineError, match="refused"):
            reread.use(RUN, first, 10, 8, formed_ms=FORMED)
        assert (
            reread.why_refused(RUN, "dd" * 32, 11, formed_ms=FORMED) is None
            and reread.next_batch(RUN, "cc" * 32, 15, formed_ms=FORMED) == 3
        )
    assert len(_marks_in(path)) == 2  # the 1101 groups of step 10 are gone from the file


def test_a_frozen_run_forms_more_groups_than_the_marks_hold_and_none_is_refused(tmp_path: Path) -> None:
    """A synthetic run's step never advances, so no mark was ever dropped by step: each group formed at the one
    step added a mark for good, and once the file was full (8192 entries) every new group was refused, for good.
    A group id now binds its formation's nonce, so the marks of the oldest formations are dropped for room and a
    floor refuses their groups: here a file of at most 8 entries sees 40 formations of the same two members at
    step 0, none refused; every batch number of every id is used once, across restarts (the marks are read back
    from disk before each group); and an id whose mark was dropped is refused, never numbered from 0 again."""
    path = tmp_path / "marks.json"
    members = [i.node_id for i in IDS]
    used: dict[str, list[int]] = {}
    formed: dict[str, int] = {}
    for k in range(40):
        nonce = nonce_at(1_700_000_000.0 + k)  # a new formation of the same members, one second later
        gid = group_id(RUN, 0, members, LAYOUT, nonce)
        assert gid not in used  # each formation is another group
        formed[gid] = nonce_formed_ms(nonce)
        marks = BatchMarks(path, max_marks=8)  # a restart of the node before each group
        assert marks.why_refused(RUN, gid, 0, formed_ms=formed[gid]) is None, k
        first = marks.next_batch(RUN, gid, 0, formed_ms=formed[gid])
        assert first == 0  # a new id starts at 0: no opening of an older formation is signed again
        for batch in range(first, first + 3):
            marks.use(RUN, gid, 0, batch, formed_ms=formed[gid])
            used.setdefault(gid, []).append(batch)
        assert len(_marks_in(path)) + 1 <= 8  # the run's entry and its marks: never past the bound
    reread = BatchMarks(path, max_marks=8)
    kept = {g for g, *_ in _marks_in(path)}
    assert len(kept) == 7 and kept == set(list(used)[-7:])  # the newest formations' marks
    assert reread.formed_floor(RUN) == formed[list(used)[-8]] + 1
    for gid, batches in used.items():
        if gid in kept:  # a kept group goes on past every number it used
            assert reread.next_batch(RUN, gid, 0, formed_ms=formed[gid]) == max(batches) + 1
            with pytest.raises(PipelineError, match="already used"):
                reread.use(RUN, gid, 0, max(batches), formed_ms=formed[gid])
            continue
        assert "dropped the batch marks" in (reread.why_refused(RUN, gid, 0, formed_ms=formed[gid]) or "")
        with pytest.raises(PipelineError, match="refused"):
            reread.next_batch(RUN, gid, 0, formed_ms=formed[gid])
        with pytest.raises(PipelineError, match="refused"):
            reread.use(RUN, gid, 0, 0, formed_ms=formed[gid])
    # A group of another run is not held to this run's formation floor.
    assert reread.why_refused("other-run", "ee" * 32, 0, formed_ms=0) is None


def test_batch_marks_drop_older_files_marks_first_and_refuse_only_with_nothing_to_drop(
    tmp_path: Path,
) -> None:
    """Marks read from a v1-v3 file name ids computed without a nonce, which no group record makes any more: they
    are the first to go for room, and raise no floor. A new group is refused for room only when the entries are
    all runs' floors, with no mark to drop (here a bound of 1 entry)."""
    path = tmp_path / "marks.json"
    path.write_text(json.dumps({"format": "prime-node/pipeline-batch-marks/v1", "next": [["aa" * 32, 4]]}))
    marks = BatchMarks(path, max_marks=3)
    assert marks.next_batch(RUN, "aa" * 32, 0, formed_ms=5) == 4  # kept while there is room
    marks.use(RUN, "bb" * 32, 1, 0, formed_ms=FORMED)  # the run's entry, the v1 mark and this one: full
    marks.use(RUN, "cc" * 32, 1, 0, formed_ms=FORMED + 1)  # the v1 mark goes, not an older formation's
    assert {g for g, *_ in _marks_in(path)} == {"bb" * 32, "cc" * 32} and marks.formed_floor(RUN) == 0
    marks.use(
        RUN, "dd" * 32, 1, 0, formed_ms=FORMED + 2
    )  # now the oldest formation goes, and the floor rises
    assert marks.formed_floor(RUN) == FORMED + 1
    assert "before" in (marks.why_refused(RUN, "ee" * 32, 1, formed_ms=FORMED) or "")  # formed too early
    assert marks.why_refused(RUN, "ee" * 32, 1, formed_ms=FORMED + 1) is None  # formed after the dropped one
    marks.use(RUN, "cc" * 32, 1, 1, formed_ms=FORMED + 1)  # a group it has a mark of still runs
    assert "holds no mark it could drop" in (
        BatchMarks(None, max_marks=1).why_refused(RUN, "aa" * 32, 1, formed_ms=0) or ""
    )
    # A v1 file names no steps: its marks are never dropped by step.
    path.write_text(json.dumps({"format": "prime-node/pipeline-batch-marks/v1", "next": [["aa" * 32, 4]]}))
    old = BatchMarks(path, keep_steps=1)
    old.use(RUN, "bb" * 32, 100, 0, formed_ms=FORMED)
    reread = BatchMarks(path)
    assert (
        reread.floor(RUN) == 99
        and reread.next_batch(RUN, "aa" * 32, 99, formed_ms=FORMED) == 4
        and reread.next_batch(RUN, "bb" * 32, 100, formed_ms=FORMED) == 1
    )


def test_a_re_formed_group_starts_its_own_batch_numbers(tmp_path: Path) -> None:
    """The same members at the same step formed again (the coordinator dissolved and re-formed them) are another
    group: its numbers begin at 0 while the first formation's continue from its own mark, so no opening is ever
    signed twice (an opening names the group id, which differs)."""
    path = tmp_path / "marks.json"
    members = [i.node_id for i in IDS]
    first, again = (nonce_at(1_700_000_000.0), nonce_at(1_700_000_060.0))
    ids = [group_id(RUN, 0, members, LAYOUT, n) for n in (first, again)]
    marks = BatchMarks(path)
    for batch in range(5):
        marks.use(RUN, ids[0], 0, batch, formed_ms=nonce_formed_ms(first))
    reread = BatchMarks(path)
    assert reread.next_batch(RUN, ids[1], 0, formed_ms=nonce_formed_ms(again)) == 0
    assert reread.next_batch(RUN, ids[0], 0, formed_ms=nonce_formed_ms(first)) == 5
    openings = {GroupSpec(RUN, 0, 0, LAYOUT, tuple(members), n).opening(0) for n in (first, again)}
    assert len(openings) == 2


async def test_a_follower_records_no_batch_number_its_predecessor_did_not_sign_or_that_jumps_too_far(
    model_dir: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    """The follower takes its batch number from the route its predecessor dials with, which nobody signed.
    Routes naming a number with no valid opening behind it (not signed by the predecessor; signed, but for
    another batch), or a validly signed one too far past the follower's mark (one at 2^63 - 2 would leave no
    number after it: the group dead for that node across restarts), leave its durable mark where it was; the
    honest leader then runs batches with it as before."""
    path = tmp_path / "follower" / "batch_marks.json"
    hops, work_for, gid = LoopbackHops(), _work(model_dir), _group().group_id
    done: list[BatchDone] = []

    async def on_batch(result: BatchDone) -> None:
        done.append(result)

    def host(k: int) -> StageHost:
        return StageHost(
            IDS[k], RUN, model_dir, LAYOUT, work_for, hops, HOP, on_batch,
            marks=BatchMarks(path) if k == 1 else BatchMarks(None), retry_s=0.05, max_batch_jump=64,
        )  # fmt: skip

    def opening(batch: int, signer: Identity, named: int | None = None) -> bytes:
        """Stage 0's opening of batch `named` (default `batch`) signed by `signer` (a forgery unless IDS[0])."""
        members = tuple(i.node_id for i in IDS)
        spec = GroupSpec(RUN, 0, batch if named is None else named, LAYOUT, members, NONCE)
        writer = FrameWriter(signer, spec.opening(0).model_copy(update={"sender": signer.node_id}))
        return writer.opening()

    follower = host(1)
    hostile = [
        (5, opening(5, IDS[1])),  # not the predecessor's signature
        (7, opening(7, IDS[0], named=0)),  # the predecessor's, for batch 0
        ((1 << 63) - 2, opening((1 << 63) - 2, IDS[0])),  # the predecessor's, far past the mark
        (65, opening(65, IDS[0])),  # the predecessor's, just past the bound
    ]
    try:
        await follower.on_change(_group(), "named by the test's group")
        for batch, data in hostile:
            reader, writer = await hops.dial(Route(gid, batch, 1), IDS[1].node_id, 10.0)
            writer.write(data)
            await writer.drain()
            # The follower refuses and closes the stream: bounded by its own deadlines.
            assert await asyncio.wait_for(reader.read(), 20.0) == b""
            writer.close()
            assert (
                follower.marks.next_batch(RUN, gid, 0, formed_ms=FORMED) == 0
                and BatchMarks(path).next_batch(RUN, gid, 0, formed_ms=FORMED) == 0
            ), batch
            assert follower.task is not None and not follower.task.done()
        leader = host(0)
        try:
            await leader.on_change(_group(), "named by the test's group")
            deadline = time.monotonic() + 60.0
            while not {d.stage for d in done} >= {0, 1}:
                assert time.monotonic() < deadline, f"no batch in 60 s: {done}"
                await asyncio.sleep(0.05)
        finally:
            await leader.stop()
    finally:
        await follower.stop()
    assert all(d.batch < 8 for d in done), [d.batch for d in done]
    assert 0 < BatchMarks(path).next_batch(RUN, gid, 0, formed_ms=FORMED) <= 64


async def test_a_receiver_hands_in_the_evidence_that_blames_its_sender(
    model_dir: Path, one_torch_thread: None
) -> None:
    marks = [BatchMarks(None), BatchMarks(None)]
    _, lost = await _run(model_dir, marks, lambda _, lost: any(x.fraud for x in lost), tamper=uncommitted(0))
    report = next(x for x in lost if x.fraud is not None)
    assert report.stage == 1 and report.partial is None
    group = _group()
    spec = GroupSpec(RUN, 0, report.batch, LAYOUT, tuple(group.members), group.nonce)
    work = _work(model_dir)(group, report.batch)
    gwork = GroupWork(
        [r.prompt_ids for r in work.requests],
        [r.seed for r in work.requests],
        PARAMS.temperature,
        PARAMS.max_new_tokens,
        work.eos_token_id,
        MICRO,
    )
    verdict = check_fraud(spec, report.fraud, gwork)  # type: ignore[arg-type]
    assert verdict.blamed == 0, verdict.reason


async def test_a_broken_batch_has_every_member_hand_in_its_partial_record(
    model_dir: Path, one_torch_thread: None
) -> None:
    marks = [BatchMarks(None), BatchMarks(None)]

    def both_partials(_: list[BatchDone], lost: list[BatchLost]) -> bool:
        return any(
            {x.stage for x in lost if x.batch == b and x.partial} == {0, 1} for b in {x.batch for x in lost}
        )

    _, lost = await _run(model_dir, marks, both_partials, tamper=drop_a_row(1, "tokens", 1))
    batch = next(
        b for b in sorted({x.batch for x in lost}) if {x.stage for x in lost if x.batch == b} == {0, 1}
    )
    records = [next(x.partial for x in lost if x.batch == batch and x.stage == k) for k in range(2)]
    # Stage 0 read stage 1's short frame; stage 1 then saw stage 0 close its stream: each names the other.
    assert [next(x.broken_by for x in lost if x.batch == batch and x.stage == k) for k in range(2)] == [
        IDS[1].node_id,
        IDS[0].node_id,
    ]
    group = _group()
    spec = GroupSpec(RUN, 0, batch, LAYOUT, tuple(group.members), group.nonce)
    work = _work(model_dir)(group, batch)
    rules = BatchRules(
        work.eos_token_id, PARAMS.max_new_tokens, cut_of([r.prompt_ids for r in work.requests], MICRO)
    )
    verdict = blame_broken(spec, records, rules)
    assert verdict.blamed == 1, verdict.reason


async def test_a_group_whose_batches_keep_breaking_is_given_up(
    model_dir: Path, one_torch_thread: None
) -> None:
    """A neighbour that breaks every batch (here stage 1 drops a row each time) would have the others write a
    file about each, every retry_s, for as long as the group stands (its members stay live and confirm it, so
    the coordinator keeps it). After `leave_after_broken` broken batches in a row the stage task ends and
    `on_give_up` tells the owner (which leaves the group); nothing more is handed in for it."""
    hops, work_for = LoopbackHops(), _work(model_dir)
    lost: list[BatchLost] = []
    gave_up: list[tuple[int, str, str, bool]] = []

    async def on_batch(result: BatchDone) -> None:
        pass

    async def on_lost(result: BatchLost) -> None:
        lost.append(result)

    def host(k: int) -> StageHost:
        return StageHost(
            IDS[k], RUN, model_dir, LAYOUT, work_for, hops, HOP, on_batch, on_lost=on_lost,
            tamper=drop_a_row(1, "tokens", 1), retry_s=0.05, leave_after_broken=3,
            on_give_up=lambda group, why, failed: gave_up.append((k, group.group_id, why, failed)),
        )  # fmt: skip

    hosts = [host(0), host(1)]
    try:
        for h in hosts:
            await h.on_change(_group(), "named by the test's group")
        deadline = time.monotonic() + 60.0
        while not any(k == 0 for k, *_ in gave_up):
            assert time.monotonic() < deadline, f"stage 0 did not give up in 60 s: {len(lost)} lost"
            await asyncio.sleep(0.05)
        leader = hosts[0].task
        assert leader is not None
        await asyncio.wait_for(leader, 10.0)  # it ended by itself
        handed_in = len([x for x in lost if x.stage == 0])
        await asyncio.sleep(0.3)  # several retry_s: nothing more from stage 0
        assert len([x for x in lost if x.stage == 0]) == handed_in <= 3
    finally:
        for h in hosts:
            await h.stop()
    gid = _group().group_id
    for k, named, why, failed in gave_up:
        assert named == gid and "3 batches in a row broke" in why, why
        assert failed  # the group's batches failed: the owner names it as left in its heartbeat
        assert hosts[k].given_up[gid] == why


async def test_a_successor_still_loading_its_stage_does_not_count_as_breaking_batches(
    model_dir: Path, one_torch_thread: None
) -> None:
    """The leader's batch is in flight from the start: while stage 1 still loads its stage (here 1.5 s), each
    of the leader's batches breaks after connect_timeout_s (0.2 s) with nobody to take it. Those are no
    neighbour's doing and do not count toward leave_after_broken (2 here; before, they did and this honest
    group dissolved after 0.5 s); once stage 1 is up, batches finish."""
    hops, work_for = LoopbackHops(), _work(model_dir)
    hop = HopSettings(frame_timeout_s=10.0, connect_timeout_s=0.2)
    done: list[BatchDone] = []
    gave_up: list[str] = []

    async def on_batch(result: BatchDone) -> None:
        done.append(result)

    def slow_load(checkpoint: Path, layout: StageLayout, stage: int) -> StageModel:
        time.sleep(1.5)  # a worker thread's (StageHost loads off the loop)
        return StageModel.load(checkpoint, layout, stage)

    hosts = [
        StageHost(
            IDS[k], RUN, model_dir, LAYOUT, work_for, hops, hop, on_batch, retry_s=0.05,
            load_stage=slow_load if k == 1 else StageModel.load, leave_after_broken=2,
            leave_without_batch_s=60.0, on_give_up=lambda _, why, __: gave_up.append(why),
        )
        for k in range(2)
    ]  # fmt: skip
    try:
        for h in hosts:
            await h.on_change(_group(), "named by the test's group")
        deadline = time.monotonic() + 60.0
        while not {d.stage for d in done} >= {0, 1}:
            assert not gave_up, gave_up
            assert time.monotonic() < deadline, f"no batch finished in 60 s: {hosts[0].abandoned_count} broke"
            await asyncio.sleep(0.05)
    finally:
        for h in hosts:
            await h.stop()
    assert hosts[0].abandoned_count >= 3, "the leader's first batches should have broken while stage 1 loaded"
    assert not gave_up, gave_up


async def test_a_successor_that_never_takes_a_batch_is_left_after_the_time_limit(model_dir: Path) -> None:
    """A member that never takes the stream breaks no batch after the ring closed, so leave_after_broken never
    fires; leave_without_batch_s does: no batch finished in that long, the group is given up."""
    gave_up: list[tuple[str, bool]] = []

    async def on_batch(result: BatchDone) -> None:
        raise AssertionError("a batch finished with no stage 1")

    hop = HopSettings(frame_timeout_s=10.0, connect_timeout_s=0.1)
    host = StageHost(
        IDS[0], RUN, model_dir, LAYOUT, _work(model_dir), LoopbackHops(), hop, on_batch, retry_s=0.02,
        leave_after_broken=2, leave_without_batch_s=1.0,
        on_give_up=lambda _, why, failed: gave_up.append((why, failed)),
    )  # fmt: skip
    try:
        await host.on_change(_group(), "named by the test's group")
        assert host.task is not None
        await asyncio.wait_for(host.task, 20.0)  # it ends by itself
    finally:
        await host.stop()
    assert host.abandoned_count >= 3
    assert len(gave_up) == 1 and gave_up[0][0].startswith("no batch finished in"), gave_up
    assert gave_up[0][1]  # the group's batches failed (none finished): named as left in the heartbeat


async def test_a_group_whose_batch_numbers_could_not_be_kept_is_not_run(model_dir: Path) -> None:
    """Marks of steps below the floor are gone: a group of such a step is refused before any work (its batch
    numbers would begin again at 0) and given up, so the member leaves it."""
    marks = BatchMarks(None, keep_steps=1)
    marks.use(RUN, "ee" * 32, 5, 0, formed_ms=FORMED)  # the floor is now 4; the test's group is of step 0
    gave_up: list[tuple[str, bool]] = []

    async def on_batch(result: BatchDone) -> None:
        raise AssertionError("a refused group ran a batch")

    def load(*_: object) -> StageModel:
        raise AssertionError("a refused group's stage was loaded")

    host = StageHost(
        IDS[0], RUN, model_dir, LAYOUT, _work(model_dir), LoopbackHops(), HOP, on_batch, marks=marks,
        load_stage=load, on_give_up=lambda _, why, failed: gave_up.append((why, failed)),
    )  # fmt: skip
    try:
        await host.on_change(_group(), "named by the test's group")
        assert host.task is not None
        await asyncio.wait_for(host.task, 10.0)
    finally:
        await host.stop()
    assert len(gave_up) == 1 and "policy step 0 is below 4" in gave_up[0][0], gave_up
    # This node's own marks, not the group's batches: nothing to name as left (the coordinator may cool it down).
    assert not gave_up[0][1]


async def test_a_neighbour_breaking_batches_gets_a_bounded_number_of_files_written(
    model_dir: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    """The pipeline node's side of broken batches: real partial records (stage 1 drops a row every batch) handed
    to `PipelineStage._on_lost` with a real outbox. Within the per-group and per-peer limits and while the
    outbox has room they are written; beyond, each is counted as withheld with its reason and not written (before,
    every broken batch was a file, every retry_s, for as long as the neighbour kept at it)."""

    def stage0_partials(_: list[BatchDone], lost: list[BatchLost]) -> bool:
        return len([x for x in lost if x.stage == 0 and x.partial is not None]) >= 5

    marks = [BatchMarks(None), BatchMarks(None)]
    _, lost = await _run(model_dir, marks, stage0_partials, tamper=drop_a_row(1, "tokens", 1))
    partials = [x for x in lost if x.stage == 0 and x.partial is not None][:5]

    async def on_batch(result: BatchDone) -> None:
        raise AssertionError("no stage task runs here")

    async def hand_in(name: str, max_pending: int, **limits: int) -> tuple[Outbox, NodeState]:
        settings = StartSettings(
            operator_key="ab" * 32,
            data_dir=tmp_path / name,
            run=RunSettings(run_id=RUN, pipeline=LAYOUT),
            pipeline=PipelineNodeSettings(enabled=True, **limits),
            max_pending_files=max_pending,
        )
        outbox, state = Outbox(tmp_path / name / "rollouts"), NodeState(IDS[0].node_id, None)
        # The swarm and the checkpoint keeper serve the stage's run loop, not what it hands in: none here.
        stage = PipelineStage(
            settings, IDS[0], None, None, outbox, state, tmp_path / name,  # type: ignore[arg-type]
            environment=None, on_committed=lambda *_: None, supervise=lambda _: None,
            request_stop=lambda _: None,
        )  # fmt: skip
        # Its host (set by its run loop), whose abandoned batches _on_lost counts: none here.
        stage.host = StageHost(
            IDS[0], RUN, model_dir, LAYOUT, _work(model_dir), LoopbackHops(), HOP, on_batch
        )
        for broken in partials:
            await stage._on_lost(broken)
        return outbox, state

    for name, max_pending, limits, written, reason in (
        ("group", 100, {"max_broken_files_per_group": 2}, 2, "group_limit"),
        ("peer", 100, {"max_broken_files_per_peer": 1}, 1, "peer_limit"),
        ("full", 1, {}, 1, "outbox_full"),
        ("room", 100, {}, 4, "group_limit"),  # the defaults: 4 per group
    ):
        outbox, state = await hand_in(name, max_pending, **limits)
        assert outbox.pending_count() == written, name
        assert state.pipeline is not None
        assert state.pipeline.partial_records == written and state.pipeline.withheld == 5 - written, name
        rendered = state.metrics.render().decode()
        assert f'stage_files_withheld_total{{reason="{reason}"}} {5 - written}.0' in rendered, name


def test_the_broken_file_budget_counts_per_group_and_per_peer_within_its_window() -> None:
    clock = [0.0]
    budget = BrokenFileBudget(per_group=2, per_peer=3, window_s=10.0, clock=lambda: clock[0])
    assert budget.admit("g1", ["p"]) is None and budget.admit("g1", ["p", "p"]) is None
    refused = budget.admit("g1", ["q"])
    assert refused is not None and refused.reason == "group_limit"
    assert budget.admit("g2", ["p"]) is None  # p's third
    refused = budget.admit("g3", ["q", "p"])
    assert refused is not None and refused.reason == "peer_limit" and "peer p" in refused.why
    assert budget.admit("g3", ["q"]) is None  # a refused file counted against nobody: q has one
    clock[0] = 10.0  # the first files leave the window
    assert budget.admit("g1", ["p"]) is None
    with pytest.raises(ValueError, match="positive"):
        BrokenFileBudget(per_group=0, per_peer=1, window_s=1.0)


def test_fraud_reports_have_a_quota_of_their_own() -> None:
    """A peer that hangs up until the partial records' limits are spent must not thereby silence the fraud
    report on its next bad frame (the evidence that bans it): fraud reports are counted apart, in a small quota."""
    budget = BrokenFileBudget(per_group=2, per_peer=2, window_s=10.0, fraud_per_group=2, fraud_per_peer=1)
    assert budget.admit("g", ["p"]) is None and budget.admit("g", ["p"]) is None
    assert budget.admit("g", ["p"]) is not None  # partial records: spent
    assert budget.admit("g", ["p"], fraud=True) is None  # the fraud report is still written
    refused = budget.admit("g", ["p"], fraud=True)
    assert refused is not None and refused.reason == "peer_limit" and "fraud reports" in refused.why
    assert budget.admit("g", ["q"], fraud=True) is None
    refused = budget.admit("g", ["r"], fraud=True)
    assert refused is not None and refused.reason == "group_limit"
    with pytest.raises(ValueError, match="fraud_per_peer 0"):
        BrokenFileBudget(per_group=1, per_peer=1, window_s=1.0, fraud_per_peer=0)


def test_a_partial_record_is_charged_to_the_neighbour_whose_stream_broke(tmp_path: Path) -> None:
    """In a group of three, this node (stage 1) has two neighbours; a batch the successor broke is charged to
    the successor alone, so the honest predecessor keeps its per-peer budget (before, both were charged and the
    predecessor's next batch broken by someone else went unrecorded). Unknown: both are charged."""
    layout = StageLayout(boundaries=[0, 1, 2, 4])
    ids = [Identity.from_seed(bytes([k + 7]) * 32) for k in range(2)]
    before, after = ids[0].node_id, ids[1].node_id
    members = [before, IDS[0].node_id, after]
    now = time.time()
    group = GroupRecord(
        group_id=group_id(RUN, 0, members, layout, nonce_at(now)), round=1, policy_step=0, layout=layout,
        members=members, formed_at=now, signed_at=now, nonce=nonce_at(now),
    )  # fmt: skip
    settings = StartSettings(
        operator_key="ab" * 32,
        data_dir=tmp_path,
        run=RunSettings(run_id=RUN, pipeline=layout),
        pipeline=PipelineNodeSettings(enabled=True, max_broken_files_per_peer=1),
    )
    stage = PipelineStage(
        settings, IDS[0], None, None, Outbox(tmp_path / "rollouts"), NodeState(IDS[0].node_id, None),
        tmp_path, environment=None, on_committed=lambda *_: None, supervise=lambda _: None,
        request_stop=lambda _: None,
    )  # fmt: skip

    def lost(batch: int, broken_by: str | None) -> BatchLost:
        return BatchLost(group, batch, 1, "broke", None, None, broken_by)

    async def withheld() -> list[str | None]:
        found = [await stage._withheld(lost(0, after)), await stage._withheld(lost(1, before))]
        found.append(await stage._withheld(lost(2, None)))
        return [w.reason if w is not None else None for w in found]

    assert asyncio.run(withheld()) == [None, None, "peer_limit"]


class _Watched(StageHost):
    """A StageHost that notes the thread on which each batch's record (finished or partial) is built; the real
    work runs as ever (nothing is replaced)."""

    threads: dict[str, set[int]] = {"record": set(), "partial": set()}

    def _done(self, *args):  # type: ignore[no-untyped-def]
        self.threads["record"].add(threading.get_ident())
        return super()._done(*args)

    def _lost(self, *args):  # type: ignore[no-untyped-def]
        self.threads["partial"].add(threading.get_ident())
        return super()._lost(*args)


async def test_a_stage_derives_its_work_and_signs_its_records_off_the_event_loop(
    model_dir: Path, one_torch_thread: None
) -> None:
    # Deriving a batch's work (tokenizing prompts), signing a record over every frame header and stacking the
    # final states are CPU work: on the event loop they would stall the node's heartbeats and libp2p streams.
    # The callbacks must run in worker threads, never on the loop's own.
    loop_thread = threading.get_ident()
    work_threads: set[int] = set()
    derive = _work(model_dir)

    def work_for(group: GroupRecord, batch: int) -> PipelineWork:
        work_threads.add(threading.get_ident())
        return derive(group, batch)

    breaking, broke = drop_a_row(1, "tokens", 1), []

    def break_once(sender: int, out: Outgoing) -> Outgoing:  # one broken batch (partial records), then honest
        changed = breaking(sender, out)
        if changed is out or broke:
            return out
        broke.append(sender)
        return changed

    def both(done: list[BatchDone], lost: list[BatchLost]) -> bool:
        return _enough(1)(done, lost) and {x.stage for x in lost if x.partial} == {0, 1}

    _Watched.threads = {"record": set(), "partial": set()}
    marks = [BatchMarks(None), BatchMarks(None)]
    await _run(model_dir, marks, both, tamper=break_once, host_type=_Watched, work_for=work_for)
    for what, threads in {"work": work_threads, **_Watched.threads}.items():
        assert threads and loop_thread not in threads, (what, threads, loop_thread)


def test_a_full_marks_file_of_the_largest_entries_fits_its_bound_and_reads_back(tmp_path: Path) -> None:
    """At MAX_MARKS entries of the largest values (a 128-character run id, 64-hex ids, steps and batch numbers
    near 2^63, formation times at the wire's last second), the file stays within the 1 MiB its reader takes."""
    path = tmp_path / "marks.json"
    run, top = "r" * MAX_RUN_ID, (1 << 63) - 2
    last_ms = int(MAX_UNIX_TIME * 1000)
    marks = BatchMarks(None)  # filled in memory (thousands of fsynced saves take seconds), then saved once
    for k in range(MAX_MARKS):
        marks.use(run, f"{k:064x}", top, top, formed_ms=last_ms - k)
    marks.path = path
    marks.use(run, "ff" * 32, top, top, formed_ms=last_ms)  # one more: one mark dropped, the file written
    assert len(_marks_in(path)) == MAX_MARKS - 1  # the run's entry and its marks
    assert path.stat().st_size <= MAX_FILE_BYTES, path.stat().st_size
    assert BatchMarks(path).next_batch(run, "ff" * 32, top, formed_ms=last_ms) == top + 1
