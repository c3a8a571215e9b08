"""A group of three stages through StageHost (three hosts of this process over LoopbackHops, each writing its
member's stage file as the node daemon does): the middle stage learns the batch's completions from its
predecessor's end frame (wire v4), so every member's file lists the same rows and the validator's judgement
accepts all three, each credited its share of the layers, with generation bit-identical to a monolithic
engine. A stage that passes on other completions than it was given is blamed alone, an honest middle stage
that relayed a liar's never; a malformed end frame breaks the batch and the partial records name its sender."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from prime_node.node.engine import HFEngine
from prime_node.node.pipeline.driver import Tamper
from prime_node.node.pipeline.errors import PipelineError
from prime_node.node.pipeline.group import HopSettings
from prime_node.node.pipeline.hops import LoopbackHops
from prime_node.node.pipeline.host import BatchDone, BatchLost, StageHost
from prime_node.node.pipeline.rollouts import write_member_file
from prime_node.node.pipeline.stage import Outgoing, StageProcessor, completions_of
from prime_node.node.pipeline.stage_model import StageModel
from prime_node.node.pipeline.work import GroupBatch, PipelineWork, work_for
from prime_node.node.run.settings import RunSettings
from prime_node.node.run.validation import RunTasks
from prime_node.p2p.pipeline.frames import PADDING, FrameWriter, completions_tensor, split_frames
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.swarm.group_records import GroupRecord, group_id
from prime_node.proofs.pipeline.broken import BatchRules, blame_broken
from prime_node.proofs.pipeline.records import GroupSpec, HopRecord, SignedStageRecord
from prime_node.trainer.validator.group_job import Delivery, GroupOutcome, layer_share, verify_group_files

from support.attack import make_checkpoint, run_tasks
from support.nonces import NONCE, formed_at_of
from support.pipeline import identities
from support.pipeline_attacks import rechain

LAYOUT = StageLayout(boundaries=[0, 1, 3, 4], prompts=2, micro_batch_size=2)
RUN = RunSettings(run_id="host-middle", run_seed=9, samples=2, max_new_tokens=8, pipeline=LAYOUT)
HOP = HopSettings(frame_timeout_s=10.0, connect_timeout_s=10.0)
IDS = identities(3, salt=70)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunTasks, HFEngine]:
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")
    engine = HFEngine.load(checkpoint, dtype="float32", max_batch_size=LAYOUT.micro_batch_size)
    return checkpoint, run_tasks(checkpoint), engine


def _group() -> GroupRecord:
    """The test's group: the same id on every call (its nonce is fixed)."""
    members = [i.node_id for i in IDS]
    return GroupRecord(
        group_id=group_id(RUN.run_id, 0, members, LAYOUT, NONCE),
        round=1,
        policy_step=0,
        layout=LAYOUT,
        members=members,
        formed_at=formed_at_of(NONCE),
        signed_at=time.time(),
        nonce=NONCE,
    )


def _batch(group: GroupRecord, batch: int) -> GroupBatch:
    return GroupBatch.pinned(LAYOUT, group.group_id, group.policy_step, batch)


async def _run_group(
    made: tuple[Path, RunTasks, HFEngine],
    out: Path,
    until: Callable[[list[BatchDone], list[BatchLost]], bool],
    tamper: Tamper | None = None,
    timeout_s: float = 90.0,
) -> tuple[list[BatchDone], list[BatchLost], dict[tuple[int, int], Path]]:
    """The group's three stages as hosts of this process until `until(done, lost)` (bounded); every finished
    batch written as its member's stage file, as the node daemon writes it (pipeline_stage.py)."""
    checkpoint, tasks, engine = made
    done: list[BatchDone] = []
    lost: list[BatchLost] = []
    files: dict[tuple[int, int], Path] = {}

    def derive(group: GroupRecord, batch: int) -> PipelineWork:
        return work_for(
            RUN,
            tasks,
            _batch(group, batch),
            eos_token_id=engine.eos_token_id,
            pad_token_id=engine.pad_token_id,
        )[0]

    def write(result: BatchDone) -> Path:
        batch = _batch(result.group, result.batch)
        work, assignment = work_for(
            RUN, tasks, batch, eos_token_id=engine.eos_token_id, pad_token_id=engine.pad_token_id
        )
        path = out / f"b{result.batch}-stage{result.stage}.parquet"
        write_member_file(
            path, RUN, tasks, batch, work, assignment, tuple(result.group.members), LAYOUT, NONCE, result.record,
            IDS[result.stage], result.final_states,
        )  # fmt: skip
        return path

    async def on_batch(result: BatchDone) -> None:
        files[(result.batch, result.stage)] = await asyncio.to_thread(write, result)
        done.append(result)

    async def on_lost(result: BatchLost) -> None:
        lost.append(result)

    hops = LoopbackHops()
    hosts = [
        StageHost(
            IDS[k], RUN.run_id, checkpoint, LAYOUT, derive, hops, HOP, on_batch,
            on_lost=on_lost, tamper=tamper, retry_s=0.05,
        )
        for k in range(LAYOUT.stages)
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
    return done, lost, files


def _complete(done: list[BatchDone]) -> int | None:
    """The first batch every stage finished, if any."""
    by_batch: dict[int, set[int]] = {}
    for d in done:
        by_batch.setdefault(d.batch, set()).add(d.stage)
    whole = [b for b, stages in by_batch.items() if len(stages) == LAYOUT.stages]
    return min(whole) if whole else None


def _judge(
    made: tuple[Path, RunTasks, HFEngine], files: dict[tuple[int, int], Path], batch: int
) -> GroupOutcome:
    _, tasks, engine = made
    deliveries = [Delivery(files[(batch, k)], IDS[k].node_id) for k in range(LAYOUT.stages)]
    return verify_group_files(deliveries, RUN, LAYOUT, lambda _step: (engine, tasks), complete=True)


def test_a_three_stage_group_through_stage_hosts_is_accepted_and_matches_a_monolithic_engine(
    made: tuple[Path, RunTasks, HFEngine], tmp_path: Path, one_torch_thread: None
) -> None:
    done, lost, files = asyncio.run(_run_group(made, tmp_path, lambda d, _: _complete(d) is not None))
    batch = _complete(done)
    assert batch is not None and not lost
    results = {d.stage: d for d in done if d.batch == batch}
    # Every member's record lists the batch's completions: the middle stage's too, learned from the end frame.
    outputs = results[2].record.record.outputs
    assert all(results[k].record.record.outputs == outputs for k in range(3))
    # Bit-identical to a monolithic engine cutting the same micro-batches (tokens, log-probabilities, reasons).
    _, tasks, engine = made
    work = work_for(
        RUN,
        tasks,
        _batch(_group(), batch),
        eos_token_id=engine.eos_token_id,
        pad_token_id=engine.pad_token_id,
    )[0]
    reference = engine.generate(list(work.requests), work.params, capture_hidden=False)
    completions = results[2].completions
    assert completions is not None
    assert [c.output_ids for c in completions] == [c.output_ids for c in reference]
    assert [c.output_logprobs for c in completions] == [c.output_logprobs for c in reference]
    assert [c.finish_reason for c in completions] == [c.finish_reason for c in reference]
    assert [list(c.output_ids) for c in reference] == outputs
    # The validator's judgement of the three files: each accepted, credited its share of [0, 1, 3, 4].
    judged = _judge(made, files, batch)
    assert [(o.accepted, o.failed_check) for _, o in sorted(judged.outcomes.items())] == [(True, None)] * 3
    shares = [o.credit_share for _, o in sorted(judged.outcomes.items())]
    assert shares == [layer_share(LAYOUT, k) for k in range(3)] == [0.25, 0.5, 0.25]


def _other_completions(liar: int, eos: int) -> Tamper:
    """Stage `liar` passes on other completions than it knows: one token of a sample changed, still
    well-formed (not EOS, in the vocabulary), so its successor takes it and the batch ends."""

    def tamper(stage: int, out: Outgoing) -> Outgoing:
        if stage != liar or out.kind != "end":
            return out
        table = out.tensor.clone()
        sample = next(s for s in range(table.shape[0]) if int(table[s, 1]) != PADDING)
        table[sample, 0] = 3 if int(table[sample, 0]) != 3 and eos != 3 else 4
        return dataclasses.replace(out, tensor=table)

    return tamper


@pytest.mark.parametrize("liar", [1, 0], ids=["middle", "first"])
def test_a_stage_passing_on_other_completions_is_blamed_alone(
    made: tuple[Path, RunTasks, HFEngine], tmp_path: Path, one_torch_thread: None, liar: int
) -> None:
    """The middle stage lying in its end frame is blamed and no one else; stage 0 lying to the middle stage (which
    then lists the lie in its own file) is blamed, and the honest middle stage is excused, never blamed."""
    eos = made[2].eos_token_id
    done, lost, files = asyncio.run(
        _run_group(made, tmp_path, lambda d, _: _complete(d) is not None, _other_completions(liar, eos))
    )
    batch = _complete(done)
    assert batch is not None and not lost
    middle = next(d for d in done if d.batch == batch and d.stage == 1).record.record.outputs
    last = next(d for d in done if d.batch == batch and d.stage == 2).record.record.outputs
    assert (middle != last) == (liar == 0)  # the middle stage lists what stage 0's end frame told it
    judged = _judge(made, files, batch)
    verdicts = [(o.accepted, o.failed_check) for _, o in sorted(judged.outcomes.items())]
    expected = [(False, "pipeline" if k == liar else "pipeline_group") for k in range(3)]
    assert verdicts == expected, [o.reason for _, o in sorted(judged.outcomes.items())]
    assert "end frame" in judged.outcomes[liar].reason


def test_a_malformed_end_frame_breaks_the_batch_and_its_sender_is_named(
    made: tuple[Path, RunTasks, HFEngine], tmp_path: Path, one_torch_thread: None
) -> None:
    """Stage 0 sends an end frame whose completion of a sample has a hole in its padding: the middle stage refuses
    it (listing it would make its own file malformed), the batch breaks, and blame_broken names stage 0 from the
    members' partial records."""

    def holed(stage: int, out: Outgoing) -> Outgoing:
        if stage != 0 or out.kind != "end":
            return out
        table = out.tensor.clone()
        table[0, 0] = PADDING
        return dataclasses.replace(out, tensor=table)

    def broken(_done: list[BatchDone], lost: list[BatchLost]) -> bool:
        batches = {item.batch for item in lost if item.partial is not None and item.stage == 1}
        return any(sum(1 for x in lost if x.batch == b and x.partial is not None) == 3 for b in batches)

    done, lost, _ = asyncio.run(_run_group(made, tmp_path, broken, holed))
    assert not done
    batch = next(b for b in {x.batch for x in lost} if sum(1 for x in lost if x.batch == b) == 3)
    middle = next(x for x in lost if x.batch == batch and x.stage == 1)
    assert "end frame" in middle.why and middle.broken_by == IDS[0].node_id
    records = [next(x.partial for x in lost if x.batch == batch and x.stage == k) for k in range(3)]
    spec = GroupSpec(RUN.run_id, 0, batch, LAYOUT, tuple(i.node_id for i in IDS), NONCE)
    verdict = blame_broken(spec, records, BatchRules(made[2].eos_token_id, RUN.max_new_tokens, None))
    assert verdict.blamed == 0, verdict.reason
    assert "end" in verdict.reason
    # The same end frame acknowledging an older head stage 1 (the last stage) signed, the one its previous
    # frame acknowledged, which some final token frames came after: named all the same, with or without its
    # record (judging its end frame does not depend on how far its acknowledgements reach).
    older = _end_acknowledging_older_input(records)
    for held in (older, [None, *older[1:]]):
        verdict = blame_broken(spec, held, BatchRules(made[2].eos_token_id, RUN.max_new_tokens, None))
        assert verdict.blamed == 0 and "came before sample" in verdict.reason, verdict.reason


def _end_acknowledging_older_input(records: list[SignedStageRecord | None]) -> list[SignedStageRecord | None]:
    """The partial records as they would be had stage 0's end frame acknowledged what its previous frame did:
    its own copy and stage 1's copy of that frame, each re-chained by stage 0 and the records re-signed."""
    first, middle = records[0], records[1]
    assert first is not None and middle is not None

    def older(hop: HopRecord) -> HopRecord:
        headers = list(hop.headers)
        assert headers[-1].kind == "end" and headers[-2].acknowledged != headers[-1].acknowledged
        headers[-1] = headers[-1].model_copy(update={"acknowledged": headers[-2].acknowledged})
        return rechain(hop.model_copy(update={"headers": headers}), IDS[0])

    sent = first.record.model_copy(update={"sent": older(first.record.sent)})
    received = middle.record.model_copy(update={"received": older(middle.record.received)})
    return [SignedStageRecord.sign(sent, IDS[0]), SignedStageRecord.sign(received, IDS[1]), records[2]]


def _early_end(eos: int) -> Tamper:
    """Stage 0 sends a well-formed end frame (every completion [EOS]) in place of its first prefill."""

    def tamper(stage: int, out: Outgoing) -> Outgoing:
        if stage != 0 or out.kind != "prefill" or out.micro_batch != 0:
            return out
        samples = LAYOUT.prompts * RUN.samples
        table = completions_tensor([[eos]] * samples, RUN.max_new_tokens)
        return Outgoing("end", 0, 0, list(range(samples)), table, "int64", None)

    return tamper


def _shortened_end(eos: int) -> Tamper:
    """Stage 0's end frame with one completion cut a token short (still well-formed: it ends at EOS), so the
    completions no longer agree with the decode frames stage 0 sent."""

    def tamper(stage: int, out: Outgoing) -> Outgoing:
        if stage != 0 or out.kind != "end":
            return out
        table = out.tensor.clone()
        lengths = (table != PADDING).sum(dim=1).tolist()
        sample = next(s for s, n in enumerate(lengths) if n >= 2)
        table[sample, lengths[sample] - 2] = eos
        table[sample, lengths[sample] - 1] = PADDING
        return dataclasses.replace(out, tensor=table)

    return tamper


@pytest.mark.parametrize(
    ("make_tamper", "why"),
    [(_early_end, "before the prefill of micro-batch 0"), (_shortened_end, "the frames before it call for")],
    ids=["early", "shortened"],
)
def test_a_middle_stage_refuses_an_end_frame_its_predecessors_frames_belie(
    made: tuple[Path, RunTasks, HFEngine],
    tmp_path: Path,
    one_torch_thread: None,
    make_tamper: Callable[[int], Tamper],
    why: str,
) -> None:
    """An end frame from stage 0 that does not agree with the frames it sent (one sent before any prefill, or
    one whose completion is shorter than the decode frames that carried it) is refused by the middle stage,
    which writes no stage file and charges stage 0 (`broken_by`), not itself; blame_broken names stage 0."""

    def settled(
        done: list[BatchDone], lost: list[BatchLost]
    ) -> bool:  # the middle stage refused or "finished"
        return any(x.stage == 1 and x.partial is not None for x in lost) or any(d.stage == 1 for d in done)

    done, lost, _ = asyncio.run(_run_group(made, tmp_path, settled, make_tamper(made[2].eos_token_id)))
    assert not [d for d in done if d.stage == 1]  # no batch "finished" at the middle stage
    middle = next(x for x in lost if x.stage == 1 and x.partial is not None)
    assert why in middle.why and middle.broken_by == IDS[0].node_id, middle.why
    partials = {x.stage: x.partial for x in lost if x.batch == middle.batch}
    records = [partials.get(k) for k in range(3)]
    spec = GroupSpec(RUN.run_id, 0, middle.batch, LAYOUT, tuple(i.node_id for i in IDS), NONCE)
    verdict = blame_broken(spec, records, BatchRules(made[2].eos_token_id, RUN.max_new_tokens, None))
    assert verdict.blamed == 0, verdict.reason


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        ([[5, 6, -1], [7, -1, -1]], "sample 0"),  # stops short of max_new_tokens without EOS
        ([[5, 2, -1], [2, -1, -1]], None),  # both end at EOS
        ([[5, -1, 6], [2, -1, -1]], "sample 0"),  # a hole in the padding
        ([[-1, -1, -1], [2, -1, -1]], "sample 0"),  # an empty completion
        ([[5, 2, 6], [2, -1, -1]], "sample 0"),  # a token after EOS
        ([[5, 6, 9], [7, 2, -1]], None),  # max_new_tokens reached without EOS, and EOS last
        ([[5, 6, 9], [7, -1, -1]], "sample 1"),  # stops short of max_new_tokens without EOS
        ([[5, 6, 9], [7, 2, 99]], "sample 1"),  # a token outside the vocabulary (after EOS too)
        ([[5, 6, 9], [-7, 2, -1]], "sample 1"),  # a negative id other than the padding
        ([[5, 6, 9]], "are \\[1, 3\\]"),  # another number of samples
    ],
)
def test_a_middle_stage_takes_only_well_formed_completions(rows: list[list[int]], why: str | None) -> None:
    table = torch.tensor(rows, dtype=torch.int64)

    def read() -> list[list[int]]:
        return completions_of(table, samples=2, max_new_tokens=3, eos_token_id=2, vocab_size=50)

    if why is None:
        assert read() == [[t for t in row if t != PADDING] for row in rows]
        return
    with pytest.raises(PipelineError, match=why):
        read()


def test_the_last_stage_refuses_an_end_frame_before_its_micro_batches_ended(
    made: tuple[Path, RunTasks, HFEngine],
) -> None:
    checkpoint, tasks, engine = made
    work = work_for(
        RUN, tasks, _batch(_group(), 0), eos_token_id=engine.eos_token_id, pad_token_id=engine.pad_token_id
    )[0]
    last = StageProcessor(StageModel.load(checkpoint, LAYOUT, 2), work)
    spec = GroupSpec(RUN.run_id, 0, 0, LAYOUT, tuple(i.node_id for i in IDS), NONCE)
    writer = FrameWriter(IDS[1], spec.opening(1))
    reader = spec.reader(2)
    split_frames(reader, writer.opening())
    table = completions_tensor([[5] * RUN.max_new_tokens] * len(work.requests), RUN.max_new_tokens)
    (end,) = split_frames(reader, writer.end(reader.acknowledgement(), table)[0], opening=False)
    with pytest.raises(PipelineError, match="before every micro-batch ended"):
        last.on_end(end)
