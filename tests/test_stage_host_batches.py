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

from prime_node.node.engine.hf import eos_and_pad
from prime_node.node.engine.types import SamplingParams
from prime_node.node.pipeline.batch_marks import BatchMarks
from prime_node.node.pipeline.driver import Tamper
from prime_node.node.pipeline.errors import PipelineError
from prime_node.node.pipeline.group import HopSettings
from prime_node.node.pipeline.hops import LoopbackHops
from prime_node.node.pipeline.host import BatchDone, BatchLost, StageHost
from prime_node.node.pipeline.stage import Outgoing
from prime_node.node.pipeline.work import PipelineWork
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.frames import FrameWriter
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.pipeline.transport import Route
from prime_node.p2p.swarm.group_records import GroupRecord, group_id
from prime_node.proofs.pipeline.blame import GroupWork, check_fraud
from prime_node.proofs.pipeline.broken import BatchRules, blame_broken, cut_of
from prime_node.proofs.pipeline.records import GroupSpec

from support.pipeline import random_requests, save_tiny
from support.pipeline_files import drop_a_row, uncommitted

RUN = "host-batches"
LAYOUT = StageLayout(boundaries=[0, 2, 4])
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)
SAMPLES, MICRO = 4, 2
HOP = HopSettings(frame_timeout_s=10.0, connect_timeout_s=10.0)
IDS = [Identity.from_seed(bytes([k + 1]) * 32) for k in range(2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-host-batches"))


def _group() -> GroupRecord:
    members = [i.node_id for i in IDS]
    now = time.time()
    return GroupRecord(
        group_id=group_id(RUN, 0, members),
        round=1,
        policy_step=0,
        layout=LAYOUT,
        members=members,
        formed_at=now,
        signed_at=now,
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
        assert BatchMarks(paths[k]).next_batch(gid) > max(after)
    signed = [(d.stage, d.batch) for d in first + second]
    assert len(signed) == len(set(signed))


def test_batch_marks_are_durable_bounded_and_refuse_reuse(tmp_path: Path) -> None:
    path = tmp_path / "marks.json"
    marks = BatchMarks(path, keep=2)
    marks.use("aa" * 32, 0)
    marks.use("aa" * 32, 5)
    assert BatchMarks(path).next_batch("aa" * 32) == 6
    with pytest.raises(PipelineError, match="already used"):
        marks.use("aa" * 32, 3)
    marks.use("bb" * 32, 0)
    marks.use("aa" * 32, 6)  # used last: "bb" is now the oldest
    marks.use("cc" * 32, 0)
    reread = BatchMarks(path, keep=2)
    assert [reread.next_batch(g * 32) for g in ("aa", "bb", "cc")] == [7, 0, 1]
    for text, why in (
        ("{", "unreadable"),
        (json.dumps({"format": "other", "next": []}), "format"),
        (json.dumps({"format": "prime-node/pipeline-batch-marks/v1", "next": [["aa", -1]]}), "batch number"),
    ):
        path.write_text(text)
        with pytest.raises(PipelineError, match=why):
            BatchMarks(path)


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
        spec = GroupSpec(RUN, 0, batch if named is None else named, LAYOUT, members)
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
            assert follower.marks.next_batch(gid) == 0 and BatchMarks(path).next_batch(gid) == 0, batch
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
    assert 0 < BatchMarks(path).next_batch(gid) <= 64


async def test_a_receiver_hands_in_the_evidence_that_blames_its_sender(
    model_dir: Path, one_torch_thread: None
) -> None:
    marks = [BatchMarks(None), BatchMarks(None)]
    _, lost = await _run(model_dir, marks, lambda _, lost: any(x.fraud for x in lost), tamper=uncommitted(0))
    report = next(x for x in lost if x.fraud is not None)
    assert report.stage == 1 and report.partial is None
    group = _group()
    spec = GroupSpec(RUN, 0, report.batch, LAYOUT, tuple(group.members))
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
    group = _group()
    spec = GroupSpec(RUN, 0, batch, LAYOUT, tuple(group.members))
    work = _work(model_dir)(group, batch)
    rules = BatchRules(
        work.eos_token_id, PARAMS.max_new_tokens, cut_of([r.prompt_ids for r in work.requests], MICRO)
    )
    verdict = blame_broken(spec, records, rules)
    assert verdict.blamed == 1, verdict.reason


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
