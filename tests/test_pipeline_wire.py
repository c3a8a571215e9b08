"""The activation stream's wire format against hostile senders, and a group over real TCP streams on 127.0.0.1
with an injected per-hop delay: identical output, and micro-batches overlapping stages."""

from __future__ import annotations

import asyncio
import hashlib
import struct
from pathlib import Path

import pytest
import torch

from prime_node.node.engine.hf import HFEngine
from prime_node.node.engine.types import SamplingParams
from prime_node.node.pipeline.boundaries import BoundaryOracle
from prime_node.node.pipeline.group import HopSettings, overlapped_flights, run_group
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.errors import PipelineWireError
from prime_node.p2p.pipeline.frames import (
    MAX_HEADER_BYTES,
    Acknowledgement,
    ChainReader,
    FrameReader,
    FrameShapes,
    FrameWriter,
    chain_next,
    chain_start,
    completions_tensor,
    head_message,
    opening_digest,
    split_frames,
)
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.signing import canonical_json
from prime_node.proofs.pipeline.blame import GroupWork, verify_group
from prime_node.proofs.pipeline.records import GroupSpec, parse_stage_record

from support.nonces import NONCE, nonce_at
from support.pipeline import group, identities, random_requests, save_tiny

LAYOUT = StageLayout(boundaries=[0, 2, 4])
SENDER, OTHER = identities(2)
SPEC = GroupSpec("local", 3, 7, LAYOUT, (SENDER.node_id, OTHER.node_id), NONCE)
# What the sender (stage 0) acknowledges: its predecessor's (stage 1's) opening, under stage 1's signature.
_INPUT_HEAD = chain_start(canonical_json(SPEC.opening(1).model_dump(mode="json")))
ACK = Acknowledgement(
    head=_INPUT_HEAD.hex(),
    index=0,
    signature=OTHER.sign(head_message(opening_digest(SPEC.opening(1)), 0, _INPUT_HEAD)).hex(),
)


def writer() -> FrameWriter:
    return FrameWriter(SENDER, SPEC.opening(0))


def reader(max_tensor_bytes: int = 1 << 20) -> ChainReader:
    return ChainReader(SENDER.node_id, LAYOUT, max_tensor_bytes)


def activation(w: FrameWriter, tensor: torch.Tensor, **changes: object) -> bytes:
    fields: dict[str, object] = dict(
        kind="prefill",
        micro_batch=0,
        step=0,
        rows=list(range(tensor.shape[0])),
        tensor=tensor,
        dtype="float32",
        commitment=b"\x01\x02",
        acknowledged=ACK,
    )
    fields.update(changes)
    return w.frame(**fields)[0]  # type: ignore[arg-type]


def forged(w: FrameWriter, header: dict[str, object], data: bytes, *, signer: Identity = SENDER) -> bytes:
    """A frame with any header the sender (or `signer`) chooses, correctly chained and signed."""
    raw = canonical_json(header)
    w.head = chain_next(w.head, raw)
    w.index += 1
    return struct.pack(">I", len(raw)) + raw + signer.sign(head_message(w.digest, w.index, w.head)) + data


def header_of(tensor_bytes: bytes, **fields: object) -> dict[str, object]:
    base: dict[str, object] = dict(
        index=1,
        micro_batch=0,
        kind="prefill",
        step=0,
        rows=[0],
        shape=[1, 2, 4],
        dtype="float32",
        tensor_sha256=hashlib.sha256(tensor_bytes).hexdigest(),
        commitment=None,
        acknowledged=ACK.model_dump(mode="json"),
    )
    base.update(fields)
    return base


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_frames_round_trip_exactly(dtype: str) -> None:
    w = writer()
    hidden = torch.randn(2, 3, 8)
    tokens = torch.tensor([5, 9])
    data = (
        w.opening()
        + activation(w, hidden, dtype=dtype)
        + w.frame(
            kind="tokens",
            micro_batch=0,
            step=0,
            rows=[0, 1],
            tensor=tokens,
            dtype="int64",
            commitment=b"",
            acknowledged=ACK,
        )[0]
        + w.end(ACK, completions_tensor([[5], [9, 2]], 3))[0]
    )
    chain = reader()
    first, second, end = split_frames(chain, data)
    expected = hidden if dtype == "float32" else hidden.to(torch.bfloat16)
    assert torch.equal(first.tensor, expected) and torch.equal(second.tensor, tokens)
    assert end.header.kind == "end" and chain.head == w.head and len(chain.headers) == 3
    assert end.tensor.tolist() == [[5, -1, -1], [9, 2, -1]] and end.header.rows == [0, 1]


def hostile_streams() -> dict[str, tuple[bytes, str]]:
    """name -> (stream bytes after a valid opening, the error expected)."""
    cases: dict[str, tuple[bytes, str]] = {}
    good = torch.zeros(1, 2, 4)
    raw = good.numpy().tobytes()

    w = writer()
    cases["header too large"] = (struct.pack(">I", MAX_HEADER_BYTES + 1), "header; at most")
    w = writer()
    huge = header_of(b"", shape=[1, 1 << 20, 1 << 10])
    cases["oversized shape"] = (forged(w, huge, b""), "at most")
    w = writer()
    cases["wrong dtype for kind"] = (forged(w, header_of(raw, dtype="int64"), raw), "cannot carry int64")
    w = writer()
    cases["rows disagree with shape"] = (forged(w, header_of(raw, rows=[0, 1]), raw), "does not have 2 rows")
    w = writer()
    cases["truncated tensor"] = (activation(w, good)[:-3], "stream ended")
    w = writer()
    frame = bytearray(activation(w, good))
    frame[4 + struct.unpack(">I", frame[:4])[0] + 5] ^= 1  # a byte of the signature, not of the header
    cases["bad signature"] = (bytes(frame), "bad signature")
    w = writer()
    activation(w, good)  # frame 1 is never delivered: the chain breaks at frame 2
    cases["broken chain"] = (activation(w, good), "bad signature")
    w = writer()
    nan = torch.full((1, 2, 4), float("nan"))
    cases["non-finite values"] = (activation(w, nan), "NaN or infinite")
    w = writer()
    cases["bytes differ from signed hash"] = (
        forged(w, header_of(raw), torch.ones(1, 2, 4).numpy().tobytes()),
        "do not hash",
    )
    w = writer()
    cases["signed by another key"] = (forged(w, header_of(raw), raw, signer=OTHER), "bad signature")
    w = writer()
    spaced = canonical_json(header_of(raw)).replace(b",", b", ")
    w.head = chain_next(w.head, spaced)
    cases["non-canonical header"] = (
        struct.pack(">I", len(spaced)) + spaced + SENDER.sign(head_message(w.digest, 1, w.head)) + raw,
        "canonical",
    )
    # A head signed for another position, or for another batch's stream (same sender, same bytes): v3 binds both.
    for name, digest, index in (
        ("at another index", None, 2),
        (
            "for another batch's stream",
            opening_digest(GroupSpec("local", 3, 8, LAYOUT, SPEC.members, NONCE).opening(0)),
            1,
        ),
    ):
        w = writer()
        raw_header = canonical_json(header_of(raw))
        w.head = chain_next(w.head, raw_header)
        signature = SENDER.sign(head_message(digest or w.digest, index, w.head))
        cases[f"head signed {name}"] = (
            struct.pack(">I", len(raw_header)) + raw_header + signature + raw,
            "bad signature",
        )
    # An end frame carries every sample's completion, rows 0, 1, ... in order, and no commitment (v4).
    ends = torch.full((2, 3), -1, dtype=torch.int64).numpy().tobytes()
    for name, fields in {
        "end frame with its rows out of order": dict(rows=[1, 0]),
        "end frame with a commitment": dict(commitment="ab"),
        "end frame of one dimension (a v3 end frame)": dict(rows=[], shape=[0]),
    }.items():
        w = writer()
        end = header_of(ends, kind="end", rows=[0, 1], shape=[2, 3], dtype="int64") | fields
        cases[name] = (forged(w, end, ends), "an end frame carries every sample's completion")
    w = writer()
    cases["frame out of order"] = (forged(w, header_of(raw, index=2), raw), "arrived where frame 1")
    w = writer()
    unacknowledged = {k: v for k, v in header_of(raw).items() if k != "acknowledged"}
    cases["no acknowledgement (a v1 header)"] = (forged(w, unacknowledged, raw), "malformed at acknowledged")
    for name, bad in {
        "short head": {"head": ACK.head[:-2], "signature": ACK.signature},
        "upper-case signature": {"head": ACK.head, "signature": ACK.signature.upper()},
        "extra field": {**ACK.model_dump(mode="json"), "batch": 3},
        "negative index": {**ACK.model_dump(mode="json"), "index": -1},
        "no index (a v2 acknowledgement)": {"head": ACK.head, "signature": ACK.signature},
    }.items():
        w = writer()
        cases[f"acknowledgement with a {name}"] = (
            forged(w, header_of(raw, acknowledged=bad), raw),
            "malformed at acknowledged",
        )
    return cases


@pytest.mark.parametrize("case", list(hostile_streams()))
def test_hostile_frames_are_refused_with_a_reason(case: str) -> None:
    data, reason = hostile_streams()[case]
    with pytest.raises(PipelineWireError, match=reason):
        split_frames(reader(), writer().opening() + data)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_an_older_opening_is_refused(version: str) -> None:
    """v1 frames carry no acknowledgement of their input, v2 ones an acknowledgement bound to no stream: an
    older peer is refused at its opening, signed as it would sign it (v2: DOMAIN v2 || head)."""
    protocol = f"prime-node/pipeline/{version}"
    raw = canonical_json({**SPEC.opening(0).model_dump(mode="json"), "protocol": protocol})
    signature = SENDER.sign(f"prime-node/pipeline-chain/{version}".encode() + b"\x00" + chain_start(raw))
    with pytest.raises(PipelineWireError, match="not signed by the expected sender"):
        split_frames(reader(), struct.pack(">I", len(raw)) + raw + signature)
    # Signed the v3 way, its protocol is still refused.
    signature = SENDER.sign(head_message(hashlib.sha256(raw).digest(), 0, chain_start(raw)))
    with pytest.raises(PipelineWireError, match="opening is malformed at protocol"):
        split_frames(reader(), struct.pack(">I", len(raw)) + raw + signature)


def test_an_opening_from_another_sender_or_layout_is_refused() -> None:
    imposter = FrameWriter(
        OTHER, GroupSpec("local", 3, 7, LAYOUT, (OTHER.node_id, SENDER.node_id), NONCE).opening(0)
    )
    with pytest.raises(PipelineWireError, match="not signed by the expected sender"):
        split_frames(reader(), imposter.opening())
    four = ChainReader(SENDER.node_id, StageLayout(boundaries=[0, 1, 2, 3, 4]))
    with pytest.raises(PipelineWireError, match="the run has 4 stages"):
        split_frames(four, writer().opening())


@pytest.mark.parametrize(
    "other",
    [
        GroupSpec("local", 3, 8, LAYOUT, SPEC.members, NONCE),
        GroupSpec("local", 4, 7, LAYOUT, SPEC.members, NONCE),
        # The same members, step and batch of another formation (another nonce): another group.
        GroupSpec("local", 3, 7, LAYOUT, SPEC.members, nonce_at(1_700_000_001.0)),
    ],
)
def test_a_stage_refuses_its_predecessors_opening_for_another_batch_or_step(other: GroupSpec) -> None:
    # Correctly signed by the right sender for the right stage, but for another batch (or policy step, or
    # formation, hence group): read on, its frames would be acknowledged in the receiver's record and the
    # receiver blamed.
    wrong = FrameWriter(SENDER, other.opening(0))
    with pytest.raises(PipelineWireError, match="expected group"):
        split_frames(SPEC.reader(1), wrong.opening())
    assert split_frames(SPEC.reader(1), writer().opening()) == []  # the expected opening is read


def test_a_tensor_beyond_bf16s_range_abandons_the_batch_rather_than_the_stage_loop() -> None:
    # Finite in float32, infinite once rounded to bf16: build_proof raises ProofError, which the stage loop does
    # not catch. The check turns it into a wire error (batch abandoned), not a fraud report check_fraud could not
    # uphold either.
    from prime_node.node.pipeline.stage import check_commitment
    from prime_node.p2p.pipeline.errors import CommitmentMismatch

    w = writer()
    huge, normal = (
        torch.full((1, 256), 3.4e38),
        torch.randn(1, 256, generator=torch.Generator().manual_seed(0)),
    )
    data = w.opening() + activation(w, huge) + activation(w, normal, micro_batch=1)
    first, second = split_frames(reader(), data)
    with pytest.raises(PipelineWireError, match="frame 1: its tensor admits no commitment") as caught:
        check_commitment(first, first.tensor)
    assert not isinstance(caught.value, CommitmentMismatch)
    with pytest.raises(CommitmentMismatch, match="frame 2: the signed commitment"):
        check_commitment(second, second.tensor)


def test_a_silent_peer_times_out() -> None:
    async def scenario() -> None:
        stream = asyncio.StreamReader()
        stream.feed_data(writer().opening()[:10])
        frames = FrameReader(stream, reader(), timeout_s=0.05)
        await frames.read_opening()

    with pytest.raises(PipelineWireError, match="sent no"):
        asyncio.run(scenario())


# The batch of the frames below: one micro-batch of samples 0 and 1, prompts left-padded to 2, hidden size 4.
# The end frame carries both samples' completions: [2, max_new_tokens 3].
SHAPES = FrameShapes(
    hidden_size=4, activation_dtype="float32", micro_batches=(((0, 1), 2),), samples=2, max_new_tokens=3
)


@pytest.mark.parametrize(
    "fields",
    [
        dict(rows=[0, 1], shape=[2, 4096, 4096]),  # 128 MiB: under the wire's bound, far over the schedule's
        dict(rows=[0, 1], shape=[2, 2, 8]),  # another hidden size
        dict(rows=[0, 1], shape=[2, 2, 4], dtype="bfloat16"),  # another dtype than the run's
        dict(rows=[0, 2], shape=[2, 2, 4]),  # a row the micro-batch does not hold
        dict(micro_batch=3, rows=[0, 1], shape=[2, 2, 4]),  # a micro-batch the batch does not have
        dict(kind="decode", rows=[0, 1], shape=[2, 3, 4]),  # a decode frame of more than one position
        # an end frame with longer completions than max_new_tokens (8 MiB: under the wire's bound)
        dict(kind="end", rows=[0, 1], shape=[2, 1 << 19], dtype="int64", commitment=None),
        # an end frame from another micro-batch than 0 (there is one end frame per stream)
        dict(kind="end", micro_batch=1, rows=[0, 1], shape=[2, 3], dtype="int64", commitment=None),
    ],
)
def test_a_frame_declaring_a_shape_the_schedule_does_not_call_for_is_refused_before_its_bytes(
    fields: dict[str, object],
) -> None:
    # Only the header is on the stream: a reader that waited for the tensor would time out instead.
    async def scenario() -> None:
        w = writer()
        stream = asyncio.StreamReader()
        stream.feed_data(w.opening() + forged(w, header_of(b"", **fields), b""))
        frames = FrameReader(stream, SPEC.reader(1, SHAPES), timeout_s=5.0)
        await frames.read_opening()
        await frames.read_frame()

    with pytest.raises(
        PipelineWireError,
        match="frame 1: .*(schedule calls for|not micro-batch|the batch has|the batch calls for)",
    ):
        asyncio.run(scenario())


def test_frames_the_schedule_calls_for_pass_its_shapes() -> None:
    w = writer()
    data = (
        w.opening()
        + activation(w, torch.randn(2, 2, 4))
        + activation(w, torch.randn(1, 1, 4), kind="decode", rows=[1])
        + w.frame(
            kind="tokens",
            micro_batch=0,
            step=0,
            rows=[0, 1],
            tensor=torch.tensor([3, 4]),
            dtype="int64",
            commitment=b"",
            acknowledged=ACK,
        )[0]
        + w.end(ACK, completions_tensor([[3, 5, 7], [4]], 3))[0]
    )
    assert [f.header.kind for f in split_frames(SPEC.reader(1, SHAPES), data)] == [
        "prefill",
        "decode",
        "tokens",
        "end",
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-pipeline-wire"))


def test_group_over_tcp_with_delay_matches_monolithic_and_overlaps(
    model_dir: Path, one_torch_thread: None
) -> None:
    requests = random_requests(8, seed=11)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    engine = HFEngine.load(model_dir, dtype="float32", max_batch_size=2)
    reference = engine.generate(requests, params, capture_hidden=False)
    overlaps = {}
    for micro_batch_size in (8, 2):
        spec, processors, ids = group(
            model_dir,
            [0, 2, 4],
            requests,
            params,
            micro_batch_size=micro_batch_size,
            eos_token_id=engine.eos_token_id,
            pad_token_id=engine.pad_token_id,
        )
        run = asyncio.run(run_group(spec, processors, ids, HopSettings(delay_s=0.02, frame_timeout_s=20)))
        assert [c.output_ids for c in run.completions] == [c.output_ids for c in reference]
        work = GroupWork(
            [r.prompt_ids for r in requests],
            [r.seed for r in requests],
            1.0,
            params.max_new_tokens,
            engine.eos_token_id,
            micro_batch_size,
        )
        # As the validator receives them: bytes, read back strictly under each member's key.
        received = [
            parse_stage_record(canonical_json(r.model_dump(mode="json")), spec.members[k])
            for k, r in enumerate(run.records)
        ]
        assert received == run.records
        verdict = verify_group(spec, received, work, BoundaryOracle(engine.model, spec.layout))
        assert verdict.accepted, verdict.reason  # the records of a real-stream run verify end to end
        overlaps[micro_batch_size] = overlapped_flights(run.runners)
    assert overlaps[8] == 0  # one micro-batch: the ring is strictly sequential
    assert overlaps[2] > 0  # four: frames travel while the stages compute other micro-batches
