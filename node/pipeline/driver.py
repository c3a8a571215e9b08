"""A group's batch run in one process: every frame is signed, encoded and re-read as a peer's would be.

The loopback driver is the reference for the networked group (group.py): same StageProcessors, same frame
encoding and checks, no sockets. Tests use it for the token-for-token comparison with a monolithic node and
for fault injection; the validator's evidence (one StageRecord per stage) comes out of both alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from ...p2p.identity import Identity
from ...p2p.pipeline.errors import CommitmentMismatch
from ...p2p.pipeline.frames import ChainReader, Frame, FrameWriter, StreamOpening, split_frames
from ...proofs.pipeline.records import GroupSpec, HopFraud, HopRecord, SignedStageRecord, StageRecord
from ..engine.types import Completion
from .errors import BatchBroken, FraudDetected, PipelineError
from .stage import Outgoing, StageProcessor


def hop_record(chain: ChainReader | FrameWriter) -> HopRecord:
    if isinstance(chain, FrameWriter):
        opening = StreamOpening.model_validate_json(chain.opening_bytes)
    else:
        assert chain.opening is not None  # our own reader, opened before any frame
        opening = chain.opening
    return HopRecord(
        opening=opening, headers=list(chain.headers), head=chain.head.hex(), signature=chain.signature.hex()
    )


def stage_record(
    stage: int, identity: Identity, received: ChainReader, sent: FrameWriter, outputs: Sequence[Sequence[int]]
) -> SignedStageRecord:
    record = StageRecord(
        stage=stage,
        node_id=identity.node_id,
        received=hop_record(received),
        sent=hop_record(sent),
        outputs=[list(o) for o in outputs],
    )
    return SignedStageRecord.sign(record, identity)


def deliver(processor: StageProcessor, frame: Frame) -> Outgoing | None:
    return processor.on_tokens(frame) if processor.model.first else processor.on_activation(frame)


def deliver_checked(processor: StageProcessor, frame: Frame, chain: ChainReader) -> Outgoing | None:
    """deliver, turning a commitment that the frame's tensor belies into FraudDetected with the evidence."""
    try:
        return deliver(processor, frame)
    except CommitmentMismatch as exc:
        # The chain accepted the frame's header before the processor judged it: the evidence is the stream
        # up to the frame before, plus the frame itself.
        before = hop_record(chain).model_copy(update={"headers": list(chain.headers[:-1])})
        raise FraudDetected(str(exc), HopFraud.of(before, frame)) from None


# A hook between a stage's computation and its writer: fault injection in tests and the devnet's adversaries.
Tamper = Callable[[int, Outgoing], Outgoing]


def run_loopback(
    spec: GroupSpec,
    processors: Sequence[StageProcessor],
    identities: Sequence[Identity],
    *,
    tamper: Tamper | None = None,
) -> tuple[list[Completion], list[SignedStageRecord]]:
    """Generate the batch through every stage; the last stage's completions and every stage's record."""
    stages = spec.layout.stages
    writers = [FrameWriter(identities[k], spec.opening(k)) for k in range(stages)]
    readers = [spec.reader(k) for k in range(stages)]
    for k in range(stages):  # stage k reads stage k - 1's stream, which starts with its opening
        split_frames(readers[k], writers[(k - 1) % stages].opening())
    pending: deque[tuple[int, Outgoing]] = deque(
        (0, processors[0].start(mb)) for mb in range(len(processors[0].work.schedule))
    )
    try:
        _relay(spec, processors, writers, readers, pending, tamper)
    except FraudDetected:
        raise
    except PipelineError as exc:  # a frame the schedule does not call for: every member's partial record
        raise _broken(exc, identities, processors, readers, writers) from exc
    # The end frames go round once, from stage 0: each carries the batch's completions, which a middle stage
    # learns from its predecessor's before it sends its own (as over streams, group.py).
    try:
        for k in range(stages):
            out = processors[k].end_frame()
            if tamper is not None:
                out = tamper(k, out)
            encoded = _encode(writers[k], readers[k], out)
            (frame,) = split_frames(readers[(k + 1) % stages], encoded, opening=False)
            processors[(k + 1) % stages].on_end(frame)
    except PipelineError as exc:  # an end frame without a well-formed completion for every sample
        raise _broken(exc, identities, processors, readers, writers) from exc
    # Each stage records the completions it knows (a middle stage: those its predecessor's end frame carried).
    records = [
        stage_record(k, identities[k], readers[k], writers[k], processors[k].outputs.tokens)
        for k in range(stages)
    ]
    return processors[-1].completions(), records


def _broken(
    exc: PipelineError,
    identities: Sequence[Identity],
    processors: Sequence[StageProcessor],
    readers: list[ChainReader],
    writers: list[FrameWriter],
) -> BatchBroken:
    partial = [
        stage_record(k, identities[k], readers[k], writers[k], known_tokens(processors[k]))
        for k in range(len(processors))
    ]
    return BatchBroken(str(exc), partial)


def known_tokens(processor: StageProcessor) -> list[list[int]]:
    """The tokens a stage knows mid-batch: stage 0 those it received, the last stage those it sampled, a middle
    stage every completion once its predecessor's end frame was read, else none."""
    knows = processor.model.first or processor.model.last or processor.learned
    return [list(t) for t in processor.outputs.tokens] if knows else []


def _encode(writer: FrameWriter, reader: ChainReader, out: Outgoing) -> bytes:
    """`out` as its stage's next signed frame, acknowledging what that stage has read so far."""
    encoded, _ = writer.frame(
        kind=out.kind,
        micro_batch=out.micro_batch,
        step=out.step,
        rows=out.rows,
        tensor=out.tensor,
        dtype=out.dtype,
        commitment=out.commitment,
        acknowledged=reader.acknowledgement(),
    )
    return encoded


def _relay(
    spec: GroupSpec,
    processors: Sequence[StageProcessor],
    writers: list[FrameWriter],
    readers: list[ChainReader],
    pending: deque[tuple[int, Outgoing]],
    tamper: Tamper | None,
) -> None:
    stages = spec.layout.stages
    while pending:
        sender, out = pending.popleft()
        if tamper is not None:
            out = tamper(sender, out)
        encoded = _encode(writers[sender], readers[sender], out)
        receiver = (sender + 1) % stages
        (frame,) = split_frames(readers[receiver], encoded, opening=False)
        following = deliver_checked(processors[receiver], frame, readers[receiver])
        if following is not None:
            pending.append((receiver, following))
