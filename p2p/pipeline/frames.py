"""The activation stream between two pipeline stages: a signed opening, then framed tensors on a hash chain.

One stream carries one batch from stage k to stage k + 1 (the last stage's stream goes back to stage 0 and
carries sampled tokens). On the wire, every frame (the opening included) is

    u32 big-endian header length | header (canonical JSON) | Ed25519 signature (64 bytes) | tensor bytes

The chain starts at head_0 = SHA-256(DOMAIN || opening header) and advances per frame as
head_i = SHA-256(head_{i-1} || SHA-256(header)); each signature is the sender's over
DOMAIN || SHA-256(opening header) || u64 i || head_i (`head_message`), so every prefix of the stream is signed
and a receiver holds the sender's word for everything up to the last frame it read, even if the sender stops
mid-batch. The tensor bytes enter the chain through the header's
`tensor_sha256`. The stream ends with an "end" frame whose signed head is the stream's chain head; it carries the
batch's completions (every sample's output tokens, padded with -1: `completions_tensor`), which stage 0 learns
from the last stage's tokens frames and every later stage passes on, so a middle stage, which sees no tokens,
knows what every member's stage file lists (docs/pipeline.md, "Wire format").

Every frame header also acknowledges the sender's input: the chain head of the stream it has received so far
(its predecessor's), its index, and the predecessor's signature over them. The signature binds the head to
its stream's opening (group, batch, stage) and position, so a head from another batch or group cannot be
passed off as this stream's. The sender signs that acknowledgement with the
frame, so whoever holds its output stream also holds what input it admitted to, and a stage that withholds
its record can still be judged against its predecessor's stream (proofs/pipeline/broken.py).

A reader treats every byte as hostile: the header length is bounded before anything is read, the signature
is checked over the raw header bytes before they are parsed, the header is a strict WireModel, the tensor's
size follows from its shape and dtype and is bounded before its bytes are read, the bytes must hash to
`tensor_sha256`, and floating tensors must be finite. Tensors are raw little-endian row-major bytes (no
pickle, no torch serialisation). docs/pipeline.md, "Wire format".
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
import torch
from pydantic import Field, StringConstraints, ValidationError

from ..identity import Identity
from ..names import RUN_ID_PATTERN
from ..signing import SIGNATURE_BYTES, canonical_json, is_valid_signature
from ..wire import NodeId, Sha256Hex, WireFormatError, WireModel, describe, loads_strict
from .errors import PipelineWireError
from .layout import MAX_STAGES, StageLayout

# v2: frame headers carry `acknowledged` (v1 headers had none). v3: every head is signed with its stream's
# opening digest and index, and acknowledgements carry the index (a v2 head signature bound neither, so a stage
# could acknowledge a head replayed from another batch). v4: the end frame carries the batch's completions (v3's
# was empty, so a middle stage never learned the sampled tokens). An older peer's opening is refused.
PipelineProtocol = Literal["prime-node/pipeline/v4"]
PROTOCOL: PipelineProtocol = "prime-node/pipeline/v4"
DOMAIN = b"prime-node/pipeline-chain/v3\x00"
_INDEX = struct.Struct(">Q")
MAX_HEADER_BYTES = 64 << 10  # a header with a TOPLOC commitment of a 4096-row prefill frame fits easily
MAX_TENSOR_BYTES = 256 << 20  # one micro-batch's activations; a stage refuses anything larger unread
MAX_ROWS = 4096  # samples in one frame
MAX_DIM = 1 << 20
MAX_FRAMES = 1 << 20  # frames in one stream
MAX_COMMITMENT_HEX = 2 * 48 * 1024
PADDING = -1  # an end frame's entry after a sample's last output token
_LEN = struct.Struct(">I")
Parsed = TypeVar("Parsed", bound=WireModel)

FrameKind = Literal["prefill", "decode", "tokens", "end"]
WireDtype = Literal["float32", "bfloat16", "int64"]
# Little-endian numpy view of each wire dtype (bfloat16 travels as its 16-bit pattern).
_NUMPY: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "bfloat16": np.dtype("<u2"),
    "int64": np.dtype("<i8"),
}
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}


class StreamOpening(WireModel):
    """The first frame of a stream: which group, batch and hop it belongs to, signed by the sender."""

    protocol: PipelineProtocol
    run_id: Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN)]
    group: Sha256Hex  # the group's id (a digest of its members and policy step)
    policy_step: int = Field(ge=0, lt=1 << 63)
    batch: int = Field(ge=0, lt=1 << 63)  # the group's batch counter: the assignment derives from it
    stage: int = Field(ge=0, lt=MAX_STAGES)  # the sender's stage; the receiver is stage + 1 (mod stages)
    stages: int = Field(ge=2, le=MAX_STAGES)
    sender: NodeId  # the key that signs every head of this stream


SignatureHex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{128}$")]


class Acknowledgement(WireModel):
    """The input a frame's sender admits to: the head of the stream it had received when it sent the frame (its
    predecessor's, the opening's head before any frame), that head's index (frames read; 0: the opening), and
    the predecessor's signature over `head_message(its opening's digest, index, head)`, which it holds from
    that frame. The signature makes the claim checkable without the predecessor's record, and binds it to this
    batch's stream: an acknowledgement its predecessor never signed for this opening is the sender's own lie."""

    head: Sha256Hex
    index: int = Field(ge=0, le=MAX_FRAMES)
    signature: SignatureHex


class FrameHeader(WireModel):
    """What precedes one tensor on the stream."""

    index: int = Field(ge=1, le=MAX_FRAMES)  # 1, 2, ... in stream order (the opening is 0)
    micro_batch: int = Field(ge=0, lt=MAX_ROWS)
    # prefill: the prompt's activations; decode: one new position per row; tokens: sampled ids (last stage to
    # stage 0); end: closes the stream, carrying every sample's output tokens ([samples, max_new_tokens], padded).
    kind: FrameKind
    step: int = Field(ge=0, le=1 << 16)  # decode step that consumes (decode) or produced (tokens) the rows
    rows: list[Annotated[int, Field(ge=0, lt=1 << 24)]] = Field(
        max_length=MAX_ROWS
    )  # sample ids, in row order
    shape: list[Annotated[int, Field(ge=0, le=MAX_DIM)]] = Field(max_length=3)
    dtype: WireDtype
    tensor_sha256: Sha256Hex
    # The sender's TOPLOC commitment (hex) to the frame's real rows (docs/pipeline.md); tokens frames: to the
    # final hidden states that produced the tokens. None on end frames.
    commitment: (
        Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{2})*$", max_length=MAX_COMMITMENT_HEX)] | None
    )
    acknowledged: Acknowledgement  # the received stream's head when this frame was sent (never decreasing)


@dataclass(frozen=True)
class Frame:
    """A frame as read (or about to be written): its header, its tensor, and the signed chain head after it."""

    header: FrameHeader
    tensor: torch.Tensor
    head: bytes  # chain head after this frame
    signature: bytes  # the sender's signature over head_message(opening digest, header.index, head)


def tensor_bytes(tensor: torch.Tensor, dtype: WireDtype) -> bytes:
    """Raw little-endian row-major bytes of `tensor` in wire dtype `dtype`."""
    t = tensor.detach().to("cpu").contiguous()
    if dtype == "bfloat16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().astype(_NUMPY[dtype]).tobytes()
    return t.to(_TORCH[dtype]).numpy().astype(_NUMPY[dtype], copy=False).tobytes()


def decode_tensor(data: bytes, shape: list[int], dtype: WireDtype) -> torch.Tensor:
    """The tensor of raw bytes; PipelineWireError when the size is wrong or a float is not finite."""
    expected = math.prod(shape) * _NUMPY[dtype].itemsize
    if len(data) != expected:
        raise PipelineWireError(f"tensor has {len(data)} bytes; shape {shape} in {dtype} needs {expected}")
    array = np.frombuffer(data, dtype=_NUMPY[dtype]).reshape(shape)
    if dtype == "bfloat16":
        tensor = torch.from_numpy(array.astype(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array.astype(_NUMPY[dtype].newbyteorder("="), copy=True))
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise PipelineWireError(f"tensor of shape {shape} holds NaN or infinite values")
    return tensor


def chain_start(opening_bytes: bytes) -> bytes:
    return hashlib.sha256(DOMAIN + opening_bytes).digest()


def chain_next(head: bytes, header_bytes: bytes) -> bytes:
    return hashlib.sha256(head + hashlib.sha256(header_bytes).digest()).digest()


def opening_digest(opening: StreamOpening) -> bytes:
    """SHA-256 of the opening's canonical JSON (its wire bytes): what every head signature binds to."""
    return hashlib.sha256(canonical_json(opening.model_dump(mode="json"))).digest()


def head_message(digest: bytes, index: int, head: bytes) -> bytes:
    """What a sender signs for chain head `index` (0: the opening) of the stream whose opening digest is
    `digest`: the head alone would let a receiver pass off a head of another batch's or group's stream (they
    all come signed by the same predecessor) as one of this stream's."""
    return DOMAIN + digest + _INDEX.pack(index) + head


def check_header(header: FrameHeader, max_tensor_bytes: int) -> int:
    """The tensor's byte size; PipelineWireError for a header whose shape, rows and dtype do not agree."""
    if header.kind == "end":
        if (
            len(header.shape) != 2
            or header.shape[0] != len(header.rows)
            or header.rows != list(range(len(header.rows)))
            or header.commitment is not None
        ):
            raise PipelineWireError(
                f"frame {header.index}: an end frame carries every sample's completion (rows 0, 1, ..., shape "
                "[samples, max_new_tokens]) and no commitment"
            )
    elif not header.shape or header.shape[0] != len(header.rows):
        raise PipelineWireError(
            f"frame {header.index}: shape {header.shape} does not have {len(header.rows)} rows"
        )
    if (header.kind in ("tokens", "end")) != (header.dtype == "int64"):
        raise PipelineWireError(f"frame {header.index}: a {header.kind} frame cannot carry {header.dtype}")
    if len(set(header.rows)) != len(header.rows):
        raise PipelineWireError(f"frame {header.index}: a sample appears twice in its rows")
    size = math.prod(header.shape) * _NUMPY[header.dtype].itemsize
    if size > max_tensor_bytes:
        raise PipelineWireError(
            f"frame {header.index}: a {header.shape} {header.dtype} tensor is {size} bytes; at most "
            f"{max_tensor_bytes} allowed"
        )
    return size


@dataclass(frozen=True)
class FrameShapes:
    """What the batch's schedule lets each frame of a stream declare, compared with its header before a byte of
    its tensor is read (or a buffer for it allocated): the wire bound (MAX_TENSOR_BYTES) is far above any frame a
    batch calls for, and the receiver knows exactly which shape it awaits.

    `micro_batches`: per micro-batch, its rows (sample ids, in row order) and its prefill width (its longest
    prompt, which every row is left-padded to); `samples` and `max_new_tokens`: the end frame's shape."""

    hidden_size: int
    activation_dtype: WireDtype
    micro_batches: tuple[tuple[tuple[int, ...], int], ...]
    samples: int
    max_new_tokens: int

    def check(self, header: FrameHeader) -> None:
        """PipelineWireError naming the frame when its declared micro-batch, rows, shape or dtype are not ones the
        schedule calls for; the receiving stage still checks steps and row order once the frame is read."""
        at = f"frame {header.index}"
        if header.kind == "end":
            if header.shape != [self.samples, self.max_new_tokens] or header.micro_batch != 0:
                raise PipelineWireError(
                    f"{at}: an end frame declared as {header.shape} (micro-batch {header.micro_batch}); the batch "
                    f"calls for [{self.samples}, {self.max_new_tokens}] (micro-batch 0)"
                )
            return
        if header.micro_batch >= len(self.micro_batches):
            raise PipelineWireError(
                f"{at}: micro-batch {header.micro_batch}; the batch has {len(self.micro_batches)}"
            )
        rows, width = self.micro_batches[header.micro_batch]
        if not set(header.rows) <= set(rows) or (header.kind == "prefill" and header.rows != list(rows)):
            raise PipelineWireError(
                f"{at}: rows {header.rows[:8]} are not micro-batch {header.micro_batch}'s {list(rows)[:8]}"
            )
        n = len(header.rows)
        expected: tuple[list[int], WireDtype] = {
            "prefill": ([n, width, self.hidden_size], self.activation_dtype),
            "decode": ([n, 1, self.hidden_size], self.activation_dtype),
            "tokens": ([n], "int64"),
        }[header.kind]
        if (header.shape, header.dtype) != expected:
            raise PipelineWireError(
                f"{at}: a {header.kind} frame declared as {header.shape} {header.dtype}; the schedule calls for "
                f"{expected[0]} {expected[1]}"
            )


class FrameWriter:
    """Encodes a stream: signs the opening and every frame's chain head with the sender's identity."""

    def __init__(self, identity: Identity, opening: StreamOpening) -> None:
        if opening.sender != identity.node_id:
            raise PipelineWireError("the opening names another sender than the signing identity")
        self.identity = identity
        self.opening_bytes = canonical_json(opening.model_dump(mode="json"))
        self.digest = hashlib.sha256(self.opening_bytes).digest()
        self.head = chain_start(self.opening_bytes)
        self.index = 0
        self.headers: list[FrameHeader] = []  # every frame sent, for the stage's record
        self.signature = identity.sign(head_message(self.digest, 0, self.head))  # over the current head

    def opening(self) -> bytes:
        signature = self.identity.sign(head_message(self.digest, 0, chain_start(self.opening_bytes)))
        return _LEN.pack(len(self.opening_bytes)) + self.opening_bytes + signature

    def frame(
        self,
        *,
        kind: FrameKind,
        micro_batch: int,
        step: int,
        rows: list[int],
        tensor: torch.Tensor,
        dtype: WireDtype,
        commitment: bytes | None,
        acknowledged: Acknowledgement,
    ) -> tuple[bytes, Frame]:
        """The encoded frame and its record (header, tensor, signed head); `acknowledged`: the current head of
        the stream this stage receives (`ChainReader.acknowledgement`)."""
        self.index += 1
        data = tensor_bytes(tensor, dtype)
        header = FrameHeader(
            index=self.index,
            micro_batch=micro_batch,
            kind=kind,
            step=step,
            rows=rows,
            shape=list(tensor.shape),
            dtype=dtype,
            tensor_sha256=hashlib.sha256(data).hexdigest(),
            commitment=commitment.hex() if commitment is not None else None,
            acknowledged=acknowledged,
        )
        header_bytes = canonical_json(header.model_dump(mode="json"))
        self.head = chain_next(self.head, header_bytes)
        signature = self.signature = self.identity.sign(head_message(self.digest, self.index, self.head))
        self.headers.append(header)
        encoded = _LEN.pack(len(header_bytes)) + header_bytes + signature + data
        return encoded, Frame(header, tensor, self.head, signature)

    def end(self, acknowledged: Acknowledgement, completions: torch.Tensor) -> tuple[bytes, Frame]:
        """The stream's last frame, carrying `completions` (`completions_tensor`: what this stage knows the batch
        generated; a stage that relays passes on what it received)."""
        return self.frame(
            kind="end",
            micro_batch=0,
            step=0,
            rows=list(range(completions.shape[0])),
            tensor=completions,
            dtype="int64",
            commitment=None,
            acknowledged=acknowledged,
        )


class ChainReader:
    """Verifies one sender's stream piece by piece (no I/O): the opening, then each header before its tensor.

    Used by FrameReader over a live stream and by anything that holds a stream's bytes (tests, a loopback
    group); the order of checks is the same for both."""

    def __init__(
        self,
        expected_sender: str,
        layout: StageLayout,
        max_tensor_bytes: int = MAX_TENSOR_BYTES,
        *,
        expected: StreamOpening | None = None,
        shapes: FrameShapes | None = None,
    ) -> None:
        self.expected_sender = expected_sender
        # The whole opening a stage awaits (group, batch, stage...): without it a predecessor could send its
        # frames under another batch's or group's opening, re-sign the right one in its own record, and have
        # the receiver blamed for acknowledging frames that belong to nothing it ran.
        self.expected = expected
        self.layout = layout
        self.max_tensor_bytes = max_tensor_bytes
        self.shapes = (
            shapes  # what the schedule calls for: every header is held to it before its tensor is read
        )
        self.opening: StreamOpening | None = None
        self.digest = b""  # SHA-256 of the opening's bytes, bound into every head signature
        self.head = b""
        self.index = 0
        self.headers: list[FrameHeader] = []  # every accepted header, for the stage's record
        self.signature = b""  # the sender's signature over the current head

    def open(self, raw: bytes, signature: bytes) -> StreamOpening:
        head, digest = chain_start(raw), hashlib.sha256(raw).digest()
        if not is_valid_signature(self.expected_sender, head_message(digest, 0, head), signature):
            raise PipelineWireError("the stream's opening is not signed by the expected sender")
        opening = _parse(StreamOpening, raw, "opening")
        if opening.sender != self.expected_sender:
            raise PipelineWireError("the stream's opening names another sender than the one expected")
        if opening.stages != self.layout.stages or opening.stage >= opening.stages:
            raise PipelineWireError(
                f"the opening is for stage {opening.stage} of {opening.stages}; the run has {self.layout.stages} stages"
            )
        if self.expected is not None and opening != self.expected:
            e = self.expected
            raise PipelineWireError(
                f"the opening is for group {opening.group[:12]} step {opening.policy_step} batch {opening.batch} "
                f"stage {opening.stage} (run {opening.run_id}); expected group {e.group[:12]} step "
                f"{e.policy_step} batch {e.batch} stage {e.stage} (run {e.run_id})"
            )
        self.opening, self.digest, self.head, self.signature = opening, digest, head, signature
        return opening

    def acknowledgement(self) -> Acknowledgement:
        """What this stage's next sent frame acknowledges: the head of everything read so far, under the
        sender's signature."""
        if self.opening is None:
            raise PipelineWireError("nothing to acknowledge: the predecessor's opening has not been read")
        return Acknowledgement(head=self.head.hex(), index=self.index, signature=self.signature.hex())

    def header(self, raw: bytes, signature: bytes) -> tuple[FrameHeader, int, bytes]:
        """(header, tensor size, head after it): the signature is checked over the raw bytes first."""
        if self.opening is None:
            raise PipelineWireError("a frame arrived before the stream's opening")
        head = chain_next(self.head, raw)
        if not is_valid_signature(
            self.opening.sender, head_message(self.digest, self.index + 1, head), signature
        ):
            raise PipelineWireError(f"frame {self.index + 1}: bad signature (broken chain or forged frame)")
        header = _parse(FrameHeader, raw, f"frame {self.index + 1}")
        if header.index != self.index + 1:
            raise PipelineWireError(f"frame {header.index} arrived where frame {self.index + 1} was due")
        size = check_header(header, self.max_tensor_bytes)
        if self.shapes is not None:
            self.shapes.check(header)
        return header, size, head

    def tensor(self, header: FrameHeader, head: bytes, signature: bytes, data: bytes) -> Frame:
        if hashlib.sha256(data).hexdigest() != header.tensor_sha256:
            raise PipelineWireError(
                f"frame {header.index}: tensor bytes do not hash to the signed tensor_sha256"
            )
        tensor = decode_tensor(data, header.shape, header.dtype)
        self.head, self.index, self.signature = head, header.index, signature
        self.headers.append(header)
        return Frame(header, tensor, head, signature)


class FrameReader:
    """Reads a stream from one sender with a deadline on every read, through a ChainReader."""

    def __init__(self, reader: asyncio.StreamReader, chain: ChainReader, *, timeout_s: float) -> None:
        self.reader = reader
        self.chain = chain
        self.timeout_s = timeout_s

    async def read_opening(self) -> StreamOpening:
        return self.chain.open(*await self._read_signed())

    async def read_frame(self) -> Frame:
        header, size, head = self.chain.header(*(signed := await self._read_signed()))
        data = await self._read_exactly(size, f"frame {header.index}'s tensor")
        return self.chain.tensor(header, head, signed[1], data)

    async def _read_signed(self) -> tuple[bytes, bytes]:
        (length,) = _LEN.unpack(await self._read_exactly(_LEN.size, "a frame length"))
        if not 0 < length <= MAX_HEADER_BYTES:
            raise PipelineWireError(
                f"peer announced a {length}-byte header; at most {MAX_HEADER_BYTES} allowed"
            )
        raw = await self._read_exactly(length, "a header")
        signature = await self._read_exactly(SIGNATURE_BYTES, "a signature")
        return raw, signature

    async def _read_exactly(self, size: int, what: str) -> bytes:
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for: on 3.11 it can lose a cancellation
                return await self.reader.readexactly(size)
        except TimeoutError:
            raise PipelineWireError(f"peer sent no {what} for {self.timeout_s:.1f} s") from None
        except asyncio.IncompleteReadError as exc:
            raise PipelineWireError(f"stream ended in {what} ({len(exc.partial)} of {size} bytes)") from None
        except (OSError, ConnectionError) as exc:
            raise PipelineWireError(f"stream broke while reading {what}: {exc}") from None


def completions_tensor(outputs: Sequence[Sequence[int]], max_new_tokens: int) -> torch.Tensor:
    """An end frame's tensor: [samples, max_new_tokens] int64, row s sample s's output tokens then PADDING. A
    sample with more tokens than `max_new_tokens` is a PipelineWireError (no honest stage has one)."""
    table = torch.full((len(outputs), max_new_tokens), PADDING, dtype=torch.int64)
    for s, tokens in enumerate(outputs):
        if len(tokens) > max_new_tokens:
            raise PipelineWireError(f"sample {s} has {len(tokens)} output tokens; at most {max_new_tokens}")
        table[s, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.int64)
    return table


def completions_sha256(outputs: Sequence[Sequence[int]], max_new_tokens: int) -> str:
    """The `tensor_sha256` of the end frame that carries `outputs`: what a validator compares end frames with."""
    return hashlib.sha256(tensor_bytes(completions_tensor(outputs, max_new_tokens), "int64")).hexdigest()


def split_frames(chain: ChainReader, data: bytes, *, opening: bool = True) -> list[Frame]:
    """Every frame of stream bytes held in memory (with the opening first when `opening`), through the same
    checks as FrameReader; PipelineWireError at the first bad one."""
    view, frames, at = memoryview(data), [], 0

    def take(size: int, what: str) -> bytes:
        nonlocal at
        if at + size > len(view):
            raise PipelineWireError(f"stream ended in {what} ({len(view) - at} of {size} bytes)")
        at += size
        return bytes(view[at - size : at])

    def signed() -> tuple[bytes, bytes]:
        (length,) = _LEN.unpack(take(_LEN.size, "a frame length"))
        if not 0 < length <= MAX_HEADER_BYTES:
            raise PipelineWireError(
                f"peer announced a {length}-byte header; at most {MAX_HEADER_BYTES} allowed"
            )
        return take(length, "a header"), take(SIGNATURE_BYTES, "a signature")

    if opening:
        chain.open(*signed())
    while at < len(view):
        raw, signature = signed()
        header, size, head = chain.header(raw, signature)
        frames.append(chain.tensor(header, head, signature, take(size, f"frame {header.index}'s tensor")))
    return frames


def _parse(model: type[Parsed], raw: bytes, what: str) -> Parsed:
    """A strict WireModel of `raw`, which must also be its canonical JSON: a validator recomputes the chain from
    parsed headers, so two spellings of one header would let a sender sign one and be judged on another."""
    try:
        parsed = model.model_validate(loads_strict(raw, what))
    except WireFormatError as exc:
        raise PipelineWireError(f"{what} is not strict JSON: {exc}") from None
    except ValidationError as exc:
        raise PipelineWireError(f"{what} is malformed {describe(exc)}") from None
    if canonical_json(parsed.model_dump(mode="json")) != raw:
        raise PipelineWireError(f"{what} is not in canonical JSON (sorted keys, no spaces)")
    return parsed


def verify_chain(
    sender: str, opening: StreamOpening, headers: list[FrameHeader], head: bytes, signature: bytes
) -> bool:
    """Whether `headers` (frames 1..n after `opening`) lead to `head` and `sender` signed it: what a validator
    checks of a stage record's copy of the frames it received, without the tensors."""
    current = chain_start(canonical_json(opening.model_dump(mode="json")))
    for header in headers:
        current = chain_next(current, canonical_json(header.model_dump(mode="json")))
    message = head_message(opening_digest(opening), len(headers), head)
    return current == head and is_valid_signature(sender, message, signature)
