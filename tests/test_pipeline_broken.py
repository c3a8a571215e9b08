"""Blame in a batch that broke mid-way (proofs/pipeline/broken.py): a stage that drops a row breaks the batch
(stage 0 refuses tokens of other rows than it fed); from the members' partial records the validator names the
stage that dropped it, judged on the input its own signed frames acknowledge (so even when it withholds its
record), and never an honest one, even one that hands in nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from prime_node.node.engine.hf import HFEngine
from prime_node.node.engine.types import SamplingParams
from prime_node.node.pipeline.boundaries import BoundaryOracle
from prime_node.node.pipeline.driver import run_loopback
from prime_node.node.pipeline.errors import BatchBroken
from prime_node.p2p.pipeline.frames import (
    Acknowledgement,
    FrameWriter,
    chain_start,
    head_message,
    opening_digest,
)
from prime_node.p2p.signing import canonical_json
from prime_node.proofs.pipeline.acknowledgements import forged_acknowledgement
from prime_node.proofs.pipeline.blame import GroupWork, verify_group
from prime_node.proofs.pipeline.broken import BatchRules, blame_broken, cut_of
from prime_node.proofs.pipeline.records import SignedStageRecord

from support.pipeline import group, identities, random_requests, save_tiny
from support.pipeline_attacks import rechain
from support.pipeline_files import drop_a_row

PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0)
BOUNDARIES = [0, 1, 3, 4]  # three stages: a relay stage in the middle


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-pipeline-broken"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> HFEngine:
    return HFEngine.load(model_dir, dtype="float32")


def _broken(model_dir: Path, engine: HFEngine, tamper, batch: int = 0) -> tuple:  # noqa: ANN001
    requests = random_requests(4, seed=11)
    spec, processors, ids = group(
        model_dir,
        BOUNDARIES,
        requests,
        PARAMS,
        micro_batch_size=4,
        eos_token_id=engine.eos_token_id,
        pad_token_id=engine.pad_token_id,
        batch=batch,
    )
    work = BatchRules(engine.eos_token_id, PARAMS.max_new_tokens, cut_of([r.prompt_ids for r in requests], 4))
    with pytest.raises(BatchBroken) as broken:
        run_loopback(spec, processors, ids, tamper=tamper)
    return spec, work, broken.value.partial


@pytest.mark.parametrize(
    ("stage", "kind", "step"),
    [(1, "decode", 1), (2, "tokens", 1), (0, "decode", 1), (1, "prefill", 0)],
    ids=["relay-decode", "last-tokens", "first-decode", "relay-prefill"],
)
def test_the_stage_that_dropped_a_row_is_named(
    model_dir: Path, engine: HFEngine, stage: int, kind: str, step: int, one_torch_thread: None
) -> None:
    spec, work, partial = _broken(model_dir, engine, drop_a_row(stage, kind, step))
    verdict = blame_broken(spec, partial, work)
    assert verdict.blamed == stage, verdict.reason
    assert "carries rows" in verdict.reason
    # A culprit that withholds its record is still named: its successor holds its signed frames, each of which
    # acknowledges the input it had, and its predecessor's record holds that input. Without either witness it
    # is not judged, and no honest stage is ever blamed instead.
    withheld = [None if k == stage else r for k, r in enumerate(partial)]
    verdict = blame_broken(spec, withheld, work)
    assert verdict.blamed == stage and "carries rows" in verdict.reason, verdict.reason
    for missing in range(3):
        thin = [None if k in (stage, missing) else r for k, r in enumerate(partial)]
        assert blame_broken(spec, thin, work).blamed == (stage if missing == stage else None)
    without_witness = [None if k == (stage + 1) % 3 and stage != 0 else r for k, r in enumerate(partial)]
    if stage == 1:  # its output is also in its own record: blamed without its successor's copy
        assert blame_broken(spec, without_witness, work).blamed == stage


def test_a_stage_that_hands_in_nothing_cannot_be_framed(
    model_dir: Path, engine: HFEngine, one_torch_thread: None
) -> None:
    """Stage 1 drops a row. The last stage then signs a tokens stream whose token, for a row stage 0 fed on,
    is EOS (its own outputs say so): judged on that stream alone, stage 0 would have fed a finished sample.
    Stage 0 hands in nothing, but its frames (in stage 1's record) acknowledge heads of the stream the last
    stage really sent, each signed by it at its index: the re-signed stream is its equivocation, and stage 0 is
    never named."""
    spec, work, partial = _broken(model_dir, engine, drop_a_row(1, "decode", 1))
    record = partial[2].record
    outputs = [list(o) for o in record.outputs]
    headers = list(record.sent.headers)
    at = next(i for i, h in enumerate(headers) if h.kind == "tokens" and h.step == 0)
    row = headers[at].rows[0]
    outputs[row][0] = work.eos_token_id
    tokens = np.array([outputs[r][0] for r in headers[at].rows], dtype="<i8").tobytes()
    headers[at] = headers[at].model_copy(update={"tensor_sha256": hashlib.sha256(tokens).hexdigest()})
    lie = rechain(record.sent.model_copy(update={"headers": headers}), ids_of(spec)[2])
    framing = partial[2].model_copy(
        update={"record": record.model_copy(update={"sent": lie, "outputs": outputs})}
    )
    verdict = blame_broken(spec, [None, partial[1], framing], work)
    assert verdict.blamed == 2 and "two different heads" in verdict.reason, verdict.reason


def _with_copy_of_hop(
    signed: SignedStageRecord, hop: str, headers: list, signer: object
) -> SignedStageRecord:  # noqa: ANN001
    """The record with its `hop` copy ("sent" or "received") replaced by `headers`, re-signed by its sender."""
    record = signed.record
    copy = rechain(getattr(record, hop).model_copy(update={"headers": headers}), signer)
    return signed.model_copy(update={"record": record.model_copy(update={hop: copy})})


def _opening_ack(spec, stage: int) -> Acknowledgement:  # noqa: ANN001
    """A genuine acknowledgement of `stage`'s stream before any frame: its opening's head, signed by it."""
    opening = spec.opening(stage)
    head = chain_start(canonical_json(opening.model_dump(mode="json")))
    signature = ids_of(spec)[stage].sign(head_message(opening_digest(opening), 0, head))
    return Acknowledgement(head=head.hex(), index=0, signature=signature.hex())


def _self_signed(spec, stage: int, ack: Acknowledgement, signer) -> Acknowledgement:  # noqa: ANN001
    """`ack` re-signed by `signer` (not the predecessor `stage - 1` whose stream it names)."""
    message = head_message(opening_digest(spec.opening(stage - 1)), ack.index, bytes.fromhex(ack.head))
    return ack.model_copy(update={"signature": signer.sign(message).hex()})


def test_an_absent_stage_that_acknowledges_a_head_never_signed_or_too_little_is_named(
    model_dir: Path, engine: HFEngine, one_torch_thread: None
) -> None:
    """Stage 1 drops a row and withholds its record; its successor holds its signed frames. Frames that claim
    input stage 0 never signed, or acknowledge less input than the frame they follow from, are stage 1's own."""
    spec, work, partial = _broken(model_dir, engine, drop_a_row(1, "decode", 1))
    ids = ids_of(spec)
    held = list(partial[2].record.received.headers)
    # The acknowledgement of its first frame re-signed by stage 1 itself: a head stage 0 never signed.
    own = _self_signed(spec, 1, held[0].acknowledged, ids[1])
    lie = [held[0].model_copy(update={"acknowledged": own}), *held[1:]]
    verdict = blame_broken(
        spec, [partial[0], None, _with_copy_of_hop(partial[2], "received", lie, ids[1])], work
    )
    assert verdict.blamed == 1 and "stage 0 never signed" in verdict.reason, verdict.reason
    # Its first frame (a prefill) acknowledging only stage 0's opening (validly signed), the later ones what they
    # really had: judged frame by frame, the prefill follows from no frame it admits to have received by then.
    early = [held[0].model_copy(update={"acknowledged": _opening_ack(spec, 0)}), *held[1:]]
    verdict = blame_broken(
        spec, [partial[0], None, _with_copy_of_hop(partial[2], "received", early, ids[1])], work
    )
    assert verdict.blamed == 1 and "frame 1 (prefill" in verdict.reason, verdict.reason
    assert "follows from no frame" in verdict.reason
    # Its second frame acknowledging less than its first did: stage 1 contradicts itself.
    back = [held[0], held[1].model_copy(update={"acknowledged": _opening_ack(spec, 0)}), *held[2:]]
    verdict = blame_broken(
        spec, [partial[0], None, _with_copy_of_hop(partial[2], "received", back, ids[1])], work
    )
    assert verdict.blamed == 1 and "acknowledges 0 input frames, after 1" in verdict.reason, verdict.reason


def test_a_stage_whose_frames_acknowledge_more_than_its_own_record_shows_is_named(
    model_dir: Path, engine: HFEngine, one_torch_thread: None
) -> None:
    """Stage 1 hands in a record whose copy of its input stops after the first frame (a prefix stage 0 signed),
    while its frames acknowledge more: its record contradicts its own signed frames."""
    spec, work, partial = _broken(model_dir, engine, drop_a_row(2, "tokens", 1))
    received = list(partial[1].record.received.headers)
    assert len(received) > 1
    short = _with_copy_of_hop(partial[1], "received", received[:1], ids_of(spec)[0])
    verdict = blame_broken(spec, [partial[0], short, partial[2]], work)
    assert verdict.blamed == 1 and "its own record does not show" in verdict.reason, verdict.reason


def test_a_complete_batch_with_an_acknowledgement_never_signed_blames_its_sender(
    model_dir: Path, engine: HFEngine, one_torch_thread: None
) -> None:
    """A finished batch is judged whole (verify_group): a stage whose frame acknowledges a head its predecessor
    never signed is named there too, though every hop's copies agree."""
    requests = random_requests(4, seed=11)
    spec, processors, ids = group(
        model_dir,
        BOUNDARIES,
        requests,
        PARAMS,
        micro_batch_size=4,
        eos_token_id=engine.eos_token_id,
        pad_token_id=engine.pad_token_id,
    )
    _, records = run_loopback(spec, processors, ids)
    work = GroupWork(
        [r.prompt_ids for r in requests],
        [r.seed for r in requests],
        PARAMS.temperature,
        PARAMS.max_new_tokens,
        engine.eos_token_id,
        4,
    )
    oracle = BoundaryOracle(engine.model, spec.layout)
    assert verify_group(spec, records, work, oracle).accepted
    sent = list(records[1].record.sent.headers)
    own = _self_signed(spec, 1, sent[1].acknowledged, ids[1])
    sent[1] = sent[1].model_copy(update={"acknowledged": own})
    lied = [
        records[0],
        _resigned(_with_copy_of_hop(records[1], "sent", sent, ids[1]), ids[1]),
        _resigned(_with_copy_of_hop(records[2], "received", sent, ids[1]), ids[2]),
    ]
    verdict = verify_group(spec, lied, work, oracle)
    assert verdict.blamed == 1 and "stage 0 never signed" in verdict.reason, verdict.reason


def _resigned(signed: SignedStageRecord, identity: object) -> SignedStageRecord:  # noqa: ANN001
    return SignedStageRecord.sign(signed.record, identity)  # type: ignore[arg-type]


def test_a_predecessor_that_re_signs_its_stream_cannot_frame_an_absent_stage(
    model_dir: Path, engine: HFEngine, one_torch_thread: None
) -> None:
    """The last stage drops a row; stage 1 (honest) hands in nothing; stage 0 hands in a record whose sent stream
    (re-signed by it) drops a row from its prefill, so that stage 1's honest prefill would look like an added
    row. With no cut to judge stage 0's prefills by, only stage 1's acknowledgements stand between it and the
    blame: they name heads of the stream stage 0 really sent, each signed by stage 0 at its index, which the
    re-signed stream contradicts at index 1: stage 0 signed two streams and is named, never stage 1."""
    spec, work, partial = _broken(model_dir, engine, drop_a_row(2, "tokens", 1))
    no_cut = BatchRules(work.eos_token_id, work.max_new_tokens, None)
    sent = list(partial[0].record.sent.headers)
    assert sent[0].kind == "prefill"
    sent[0] = sent[0].model_copy(
        update={"rows": sent[0].rows[:-1], "shape": [len(sent[0].rows) - 1, *sent[0].shape[1:]]}
    )
    framing = _with_copy_of_hop(partial[0], "sent", sent, ids_of(spec)[0])
    verdict = blame_broken(spec, [framing, None, partial[2]], no_cut)
    assert verdict.blamed == 0 and "two different heads at index 1" in verdict.reason, verdict.reason
    # Judged on stage 0's re-signed copy alone, stage 1's prefill would not follow: the acknowledgement is what
    # keeps it out (its honest frames acknowledge the stream stage 0 really sent, one frame in).
    assert partial[2].record.received.headers[0].rows == partial[0].record.sent.headers[0].rows


def test_a_forged_copy_and_an_equivocation_are_named(
    model_dir: Path, engine: HFEngine, one_torch_thread: None
) -> None:
    spec, work, partial = _broken(model_dir, engine, drop_a_row(1, "decode", 1))
    # Stage 2 claims stage 1 sent it other headers: its copy is not signed by 1, so stage 2 forged it.
    record = partial[2].record
    headers = [h.model_copy(update={"rows": h.rows[:1]}) for h in record.received.headers]
    forged = record.model_copy(update={"received": record.received.model_copy(update={"headers": headers})})
    verdict = blame_broken(
        spec, [partial[0], partial[1], partial[2].model_copy(update={"record": forged})], work
    )
    assert verdict.blamed == 2 and "not signed by 1" in verdict.reason, verdict.reason
    # Stage 1's own record shows another stream than the one stage 2 holds, both signed by 1: equivocation.
    sent = partial[1].record.sent
    other = rechain(sent.model_copy(update={"headers": headers}), ids_of(spec)[1])
    lying = partial[1].record.model_copy(update={"sent": other})
    verdict = blame_broken(
        spec, [partial[0], partial[1].model_copy(update={"record": lying}), partial[2]], work
    )
    assert verdict.blamed == 1 and "two different streams" in verdict.reason, verdict.reason


@pytest.mark.parametrize("stage", [1, 0], ids=["relay", "first"])
@pytest.mark.parametrize("source", ["previous-batch", "another-group"])
def test_a_stage_that_replays_acknowledgements_of_another_stream_is_named(
    model_dir: Path, engine: HFEngine, stage: int, source: str, one_torch_thread: None
) -> None:
    """A stage receives its predecessor's signature on every head of every batch it runs. The one that drops a
    row in batch 1 and withholds its record stamps its frames with the acknowledgements it sent in an honest
    batch (the previous one of this group, or one of another group with the same predecessor): genuine
    signatures, but over another stream's opening, so its own lie and not an end of what is judged of it."""
    predecessor = (stage - 1) % 3
    ids = identities(3)
    members = list(ids)
    if source == "another-group":  # the same predecessor and replaying stage, another third member
        members[(stage + 1) % 3] = identities(1, salt=40)[0]
    requests = random_requests(4, seed=11)
    old_spec, processors, _ = group(
        model_dir,
        BOUNDARIES,
        requests,
        PARAMS,
        micro_batch_size=4,
        eos_token_id=engine.eos_token_id,
        pad_token_id=engine.pad_token_id,
        batch=0 if source == "previous-batch" else 1,
        members=members,
    )
    _, old = run_loopback(old_spec, processors, members)
    replayed = [h.acknowledged for h in old[stage].record.sent.headers]
    # The material is genuine: the predecessor signed every one of those heads, on its stream of that batch.
    assert (
        forged_acknowledgement(
            list(old[stage].record.sent.headers), old_spec.opening(predecessor), ids[predecessor].node_id
        )
        is None
    )

    spec, work, partial = _broken(model_dir, engine, drop_a_row(stage, "decode", 1), batch=1)
    assert spec.opening(predecessor) != old_spec.opening(predecessor)
    successor = (stage + 1) % 3
    held = list(partial[successor].record.received.headers)
    stamped = [
        h.model_copy(update={"acknowledged": replayed[min(i, len(replayed) - 1)]}) for i, h in enumerate(held)
    ]
    witness = _resigned(
        _with_copy_of_hop(partial[successor], "received", stamped, ids[stage]), ids[successor]
    )
    records = [witness if k == successor else None if k == stage else r for k, r in enumerate(partial)]
    verdict = blame_broken(spec, records, work)
    assert verdict.blamed == stage and "never signed" in verdict.reason, verdict.reason


def test_an_acknowledged_head_that_differs_from_the_signed_copy_is_the_predecessors_equivocation(
    model_dir: Path, engine: HFEngine, one_torch_thread: None
) -> None:
    """Stage 0 signs another head at index 1 of its stream than the one its record's copy leads through; stage 1
    (record withheld) acknowledges that head: both are stage 0's signatures on this batch's stream, so stage 0
    signed two streams and is named, not stage 1."""
    spec, work, partial = _broken(model_dir, engine, drop_a_row(1, "decode", 1))
    ids = ids_of(spec)
    real = partial[0].record.sent.headers[0]
    other = FrameWriter(ids[0], spec.opening(0))
    other.frame(
        kind=real.kind,
        micro_batch=real.micro_batch,
        step=real.step,
        rows=list(real.rows),
        tensor=torch.zeros(real.shape),
        dtype=real.dtype,
        commitment=None,
        acknowledged=real.acknowledged,
    )
    split = Acknowledgement(head=other.head.hex(), index=1, signature=other.signature.hex())
    held = list(partial[2].record.received.headers)
    assert held[0].acknowledged.index == 1  # stage 1's first frame follows stage 0's first
    held[0] = held[0].model_copy(update={"acknowledged": split})
    witness = _resigned(_with_copy_of_hop(partial[2], "received", held, ids[1]), ids[2])
    verdict = blame_broken(spec, [partial[0], None, witness], work)
    assert verdict.blamed == 0 and "two different heads at index 1" in verdict.reason, verdict.reason


def ids_of(spec):  # noqa: ANN001, ANN201
    """The identities support.pipeline.group signs with (identities(stages)), checked against the spec."""
    ids = identities(spec.layout.stages)
    assert tuple(i.node_id for i in ids) == spec.members
    return ids
