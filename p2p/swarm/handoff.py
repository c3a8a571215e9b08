"""Rollout hand-off: a contributor streams a signed rollout file to a validator over libp2p.

The contributor opens the stream (it needs no inbound connectivity; it may sit behind a NAT in DHT
client mode). One exchange, every frame length-prefixed and size-bounded (docs/protocol.md, "Swarm"):

    sender -> header: the signature envelope {format, node_id, sha256, size, signature}
    receiver checks: size limit, envelope signature, sender not banned, the stream's libp2p
                     peer id is the one the sender's signed heartbeat names, sender not cooling down,
                     admission; then waits (bounded) for a receive slot within the sender's shares
    receiver -> {"go": true} | {"refused": reason} | {"busy": reason, "retry_after_s": s}
                | {"receipt": ...} (this sender's file is already held: no body needed)
    sender -> exactly `size` raw bytes, in chunks, waiting on the stream's flow control; the receiver cuts
              a body that falls below its rate floor or passes its deadline (the sender then cools down)
    receiver: hash == header.sha256, store, acceptance callback; -> {"receipt": ...} | {"refused": reason}

A refusal is final (the validator's verdict on this file); "busy" is back-pressure (rate limit, full queue,
no receive slot, a cooldown): the sender keeps the file and tries again after `retry_after_s` (HandoffBusy is
a transport-class error). Who may hold the receive slots, and what a cut costs: p2p/swarm/slots.py.

The file itself stays opaque bytes here: nothing in it is parsed before its signature and hash check.
The envelope is the one proofs/rollout_file.py writes beside each file (FILE.parquet.sig); its format v2 also
signs the batch the file holds (policy step, batch counter), so that a validator can tell before the body
whether the work is its to judge (p2p/swarm/routing.py); format v1 (no batch) stays readable. A received file is
one sender's delivery (`DeliveryKey`: file hash and sender), stored as `<sha256>-<node_id>.parquet`
(`stored_name`): the same bytes signed by two nodes (one re-signing the other's file) are two deliveries, and
neither answers for the other. A file stored as `<sha256>.parquet` by a version from before deliveries were
keyed by sender still answers for the sender its envelope names: a resend of it is acknowledged, not stored
again.

The sender gives the whole body one wall-clock deadline, as the receiver does (grace plus its size at the
rate floor): a validator that reads slowly cannot hold a sender's hand-off past it, however steadily it drains.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal, NamedTuple

from pydantic import Field, StringConstraints, ValidationError, model_serializer, model_validator

from ..identity import Identity
from ..signing import SignatureError, verify_document
from ..wire import Timestamp, WireModel, describe
from .config import SwarmConfig
from .errors import HandoffBusy, HandoffError, HandoffRefused, HandoffTooSlow
from .framing import close_writer, read_at_rate, read_frame, write_frame
from .records import NodeId, Sha256Hex
from .routing import Batch
from .slots import Claim, Cooldowns, SlotTable, network_of

logger = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024
SIG_FORMAT: Final = "prime-node/rollout-sig/v2"  # signs the batch too: what every node of this version writes
SIG_FORMAT_V1 = "prime-node/rollout-sig/v1"  # no batch: still parsed (older files), refused by validators
SIG_FORMAT_STAGE: Final = (
    "prime-node/rollout-sig/v3"  # a pipeline stage's file: v2 plus the group it belongs to
)
FILE_SUFFIX = ".parquet"
ENVELOPE_SUFFIX = ".parquet.sig"  # the envelope beside each received file, as proofs/rollout_file.py names it
MAX_CONTROL_FRAME = 4096
SignatureHex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{128}$")]


class DeliveryKey(NamedTuple):
    """One sender's delivery of a file: what a stored file, a queue place, a hold and a verdict belong to.

    Two senders of the same bytes (one re-signing the other's file) are two deliveries."""

    sha256: str  # of the file's bytes
    node_id: str  # the sender, whose key signed the envelope


def protocol_name(run_id: str) -> str:
    return f"/prime-node/{run_id}/rollout/1"


class RolloutEnvelope(WireModel):
    """The detached signature envelope of a rollout file, exactly as proofs/rollout_file.py writes it."""

    format: Literal["prime-node/rollout-sig/v1", "prime-node/rollout-sig/v2", "prime-node/rollout-sig/v3"] = (
        SIG_FORMAT
    )
    node_id: NodeId  # the author, whose key signs
    sha256: Sha256Hex  # of the file's bytes
    size: int = Field(ge=0, le=1 << 40)  # of the file, in bytes
    # v2 only (absent in v1): the batch every row of the file belongs to, signed, so that the receiver can route
    # before the body arrives; a validator rejects a file whose rows are another batch (`signer`, fraud).
    policy_step: int | None = Field(None, ge=0, lt=1 << 63)
    batch_counter: int | None = Field(None, ge=0, lt=1 << 63)
    # v3 only (a pipeline stage's file): the group whose batch the file is, signed, so that the stage files of one
    # group's batch are routed to one validator (by group, not by sender: routing.py) and judged together.
    group: Sha256Hex | None = None
    # v3 only: a member's stage file, a receiver's fraud evidence, or a member's partial record of a broken batch.
    kind: Literal["stage", "fraud", "partial"] | None = None
    signature: SignatureHex  # Ed25519 by node_id over canonical JSON of the other fields

    @model_validator(mode="after")
    def _batch_follows_format(self) -> RolloutEnvelope:
        # v1 has no batch fields at all (not even nulls: exactly what v1 readers accept); v2 and v3 have both.
        given = {"policy_step", "batch_counter"} & self.model_fields_set
        present = (self.policy_step is not None, self.batch_counter is not None)
        batched = self.format != SIG_FORMAT_V1
        if present != ((True, True) if batched else (False, False)) or (not batched and given):
            raise ValueError(
                f"a {self.format} envelope {'signs' if batched else 'has no'} policy_step and batch_counter"
            )
        stage = self.format == SIG_FORMAT_STAGE
        given = {"group", "kind"} & self.model_fields_set
        if (self.group is not None, self.kind is not None) != (stage, stage) or (not stage and given):
            raise ValueError(f"a {self.format} envelope {'signs' if stage else 'has no'} group and kind")
        return self

    @model_serializer(mode="wrap")
    def _without_absent_batch(self, handler: Any) -> dict[str, Any]:
        # Each format is written exactly as its readers expect it: absent fields left out, not nulls.
        data = handler(self)
        if self.format == SIG_FORMAT_V1:
            data.pop("policy_step", None)
            data.pop("batch_counter", None)
        if self.format != SIG_FORMAT_STAGE:
            data.pop("group", None)
            data.pop("kind", None)
        return data

    @property
    def batch(self) -> tuple[int, int] | None:
        """(policy step, batch counter) the envelope signs; None for a v1 envelope."""
        if self.policy_step is None or self.batch_counter is None:
            return None
        return self.policy_step, self.batch_counter

    def signed_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format": self.format,
            "node_id": self.node_id,
            "sha256": self.sha256,
            "size": self.size,
        }
        if self.batch is not None:
            body["policy_step"], body["batch_counter"] = self.batch
        if self.group is not None:
            body["group"], body["kind"] = self.group, self.kind
        return body

    @property
    def routed_as(self) -> Batch | None:
        """What routing.py assigns a validator by: a stage file's group batch (the group id in place of a node's),
        or the sender's batch; None for a v1 envelope."""
        if self.batch is None:
            return None
        return Batch(self.group if self.group is not None else self.node_id, *self.batch)

    @classmethod
    def sign(
        cls,
        identity: Identity,
        data: bytes,
        batch: tuple[int, int] | None,
        group: str | None = None,
        kind: Literal["stage", "fraud", "partial"] = "stage",
    ) -> RolloutEnvelope:
        """`data`'s envelope: v2 signing `batch` (policy step, batch counter), or v1 when `batch` is None; v3
        (a pipelined group's file of `kind`) when `group` is given."""
        body: dict[str, Any] = {
            "format": SIG_FORMAT_STAGE
            if group is not None
            else SIG_FORMAT
            if batch is not None
            else SIG_FORMAT_V1,
            "node_id": identity.node_id,
            "sha256": hashlib.sha256(data).hexdigest(),
            "size": len(data),
        }
        if batch is not None:
            body["policy_step"], body["batch_counter"] = batch
        if group is not None:
            body["group"], body["kind"] = group, kind
        return cls(**body, signature=identity.sign_document(body).hex())

    def verify(self) -> None:
        """SignatureError unless `signature` is node_id's signature over the other fields."""
        verify_document(self.node_id, self.signed_body(), bytes.fromhex(self.signature))


class ReceiptBody(WireModel):
    kind: str = Field("rollout-receipt", pattern=r"^rollout-receipt$")  # no other signed document can pass
    sha256: Sha256Hex
    sender: NodeId
    receiver: NodeId  # the validator that signs this receipt
    size: int = Field(ge=0)
    received_at: Timestamp  # the sender's give-up clock starts here (node/contributor/verdicts.py)


class Receipt(WireModel):
    """The validator's signed acknowledgement that it holds the file; the sender keeps it."""

    body: ReceiptBody
    signature: SignatureHex

    def verify(self, receiver: str, sha256: str, sender: str) -> None:
        if (self.body.receiver, self.body.sha256, self.body.sender) != (receiver, sha256, sender):
            raise HandoffError("the receipt names another validator, file or sender than this hand-off")
        try:
            verify_document(receiver, self.body.model_dump(mode="json"), bytes.fromhex(self.signature))
        except SignatureError as exc:
            raise HandoffError(f"the receipt's signature does not verify: {exc}") from None


def parse_header(frame: Any) -> RolloutEnvelope:
    """The receiver's parse of a decoded header frame (framing.read_frame); HandoffRefused naming the field."""
    try:
        return RolloutEnvelope.model_validate(frame)
    except ValidationError as exc:
        raise HandoffRefused(f"malformed header {describe(exc)}") from None


def parse_receipt(document: Any) -> Receipt:
    """The sender's parse of the receipt in a decoded answer frame, before its signature is checked."""
    try:
        return Receipt.model_validate(document)
    except ValidationError as exc:
        raise HandoffError(f"malformed receipt {describe(exc)}") from None


@dataclass(frozen=True)
class ReceivedRollout:
    """A stored, signature- and hash-checked rollout file handed to the acceptance callback."""

    envelope: RolloutEnvelope
    path: Path
    peer_id: str
    size: int

    @property
    def key(self) -> DeliveryKey:
        return DeliveryKey(self.envelope.sha256, self.envelope.node_id)


@dataclass(frozen=True)
class Admitted:
    """What the validator's admission says of a header it let through."""

    established: bool  # enough recently accepted work here: it may use the reserved receive slots
    abandon: Callable[[], None] | None = None  # called when this hand-off ends without an accepted file


AcceptCallback = Callable[[ReceivedRollout], Awaitable[None] | None]  # raise HandoffRefused to refuse
PeerLookup = Callable[[str], Awaitable[str | None]]  # node id -> libp2p peer id of its live heartbeat
BanCheck = Callable[[str], Awaitable[bool]]
# raise HandoffRefused to refuse before the body, HandoffBusy to ask the sender to come back later; None
# (no admission at all) counts the sender as a newcomer
AdmitCallback = Callable[[RolloutEnvelope], Awaitable[Admitted | None]]
# The longest wait a hand-off can be told to observe: a validator's busy hint a sender honours, and the longest
# cooldown a receiver imposes on a cut-off sender (a hint above it is ignored as a hostile one).
MAX_BUSY_WAIT_S = 3600.0


def stored_name(sha256: str, node_id: str) -> str:
    """The name (without suffix) a received file is stored under: one per (file hash, sender)."""
    return f"{sha256}-{node_id}"


def body_deadline_s(config: SwarmConfig, size: int) -> float:
    """The longest a body of `size` bytes may take, on either side: grace plus its size at the rate floor."""
    return config.handoff_deadline_grace_s + size / config.handoff_min_bytes_per_s


def legacy_holds(directory: Path, key: DeliveryKey) -> bool:
    """Whether `directory` holds `key` under the name used before deliveries were keyed by sender,
    `<sha256>.parquet`, with an envelope naming this sender. Blocking (disk): run it in a thread."""
    if not (directory / f"{key.sha256}{FILE_SUFFIX}").is_file():
        return False
    try:
        with open(directory / f"{key.sha256}{ENVELOPE_SUFFIX}", "rb") as file:
            raw = file.read(MAX_CONTROL_FRAME)  # an envelope is far smaller
        return RolloutEnvelope.model_validate_json(raw).node_id == key.node_id
    except (OSError, ValueError):  # ours, damaged: not this sender's copy; the spool's recovery removes it
        return False


def _hash_and_store(data: bytes, directory: Path, envelope: RolloutEnvelope) -> str:
    # Runs in a worker thread: hashing and disk writes of up to max_rollout_bytes block for a while.
    digest = hashlib.sha256(data).hexdigest()
    if digest != envelope.sha256:
        return digest
    name = stored_name(envelope.sha256, envelope.node_id)
    for suffix, content in ((ENVELOPE_SUFFIX, envelope.model_dump_json().encode()), (FILE_SUFFIX, data)):
        # Envelope first, file last: a file that looks complete always has its signature beside it.
        tmp = directory / f".incoming-{name}{suffix}"
        tmp.write_bytes(content)
        os.replace(tmp, directory / f"{name}{suffix}")
    return digest


class RolloutReceiver:
    """The validator side: a libp2p stream handler that stores checked files under `directory`."""

    def __init__(
        self,
        identity: Identity,
        directory: Path,
        accept: AcceptCallback,
        peer_of: PeerLookup,
        is_banned: BanCheck,
        config: SwarmConfig,
        admit: AdmitCallback | None = None,
    ) -> None:
        self.identity = identity
        self._admit = admit  # rate limits and queue bounds, checked before a byte of the body is read
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._accept, self._peer_of, self._is_banned = accept, peer_of, is_banned
        self.config = config
        self._max_bytes, self._timeout_s = config.max_rollout_bytes, config.handoff_timeout_s
        self.slots = SlotTable(
            config.max_concurrent_handoffs,
            reserved=config.handoff_reserved_slots,
            per_sender=config.handoff_slots_per_sender,
            per_network=config.handoff_slots_per_network,
        )
        self.cooldowns = Cooldowns(config.handoff_cooldown_s, MAX_BUSY_WAIT_S)
        self.cut_off = 0  # bodies cut for being too slow (tests and the benchmark read it)
        self._in_progress: set[DeliveryKey] = set()  # being received

    def stored_path(self, sha256: str, node_id: str) -> Path:
        return self.directory / f"{stored_name(sha256, node_id)}{FILE_SUFFIX}"

    async def holds(self, key: DeliveryKey) -> bool:
        """Whether this delivery is stored already, under its name or the legacy one."""
        if self.stored_path(*key).exists():
            return True
        return await asyncio.to_thread(legacy_holds, self.directory, key)

    def _envelope_path(self, sha256: str, node_id: str) -> Path:
        return self.directory / f"{stored_name(sha256, node_id)}{ENVELOPE_SUFFIX}"

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(info.peer_id)
        # The remote address p2pd saw for this stream (a relay's, for a relayed stream): the network's share.
        network = network_of(getattr(info, "addr", None), group_loopback=self.config.handoff_group_loopback)
        try:
            try:
                reply = await self._exchange(peer, network, reader, writer)
            except HandoffRefused as exc:
                logger.info("refused a rollout hand-off from peer %s: %s", peer, exc.reason)
                reply = {"refused": exc.reason}
            except HandoffBusy as exc:
                logger.debug("asked peer %s to retry later: %s", peer, exc.reason)
                reply = {"busy": exc.reason, "retry_after_s": exc.retry_after_s}
            # Bounded: a peer that never reads must not keep this handler (a stream) open for ever.
            await asyncio.wait_for(write_frame(writer, reply), self._timeout_s)
        except HandoffError as exc:  # the peer broke the protocol or stalled: nothing to answer
            logger.info("rollout hand-off from peer %s failed: %s", peer, exc)
        except TimeoutError:
            logger.info(
                "rollout hand-off from peer %s: it did not take our answer within %.0f s",
                peer,
                self._timeout_s,
            )
        except (OSError, ConnectionError) as exc:  # stream reset, or our disk refused the file
            logger.warning("rollout hand-off from peer %s aborted: %s", peer, exc)
        finally:
            close_writer(writer)

    async def _exchange(
        self, peer: str, network: str | None, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> dict:
        header = parse_header(await read_frame(reader, MAX_CONTROL_FRAME, self._timeout_s))
        if header.size > self._max_bytes:
            raise HandoffRefused(f"file of {header.size} bytes exceeds the limit of {self._max_bytes}")
        try:
            header.verify()  # before a single byte of the file is read
        except SignatureError:
            raise HandoffRefused("the file signature does not verify for the claimed node id") from None
        if await self._is_banned(header.node_id):
            raise HandoffRefused("the sending node is banned")
        bound_peer = await self._peer_of(header.node_id)
        if bound_peer != peer:
            raise HandoffRefused(
                "no live heartbeat binds this libp2p peer id to the sending node id; publish one first"
            )
        # Only this sender's own delivery answers for it: another node's copy of the same bytes (a re-signed
        # file) must not stand in for it, or the first sender would decide the second one's verdict.
        delivery = DeliveryKey(header.sha256, header.node_id)
        if await self.holds(delivery):
            return {"receipt": self._receipt(header).model_dump(mode="json")}
        if delivery in self._in_progress:
            raise HandoffBusy("this file is being received on another stream", 1.0)
        self._check_cooldown(header.node_id, peer)  # after the identity checks: only its own cuts count
        self._in_progress.add(delivery)  # claimed before any await: a second stream of it is busy
        admitted: Admitted | None = None
        accepted = False
        try:
            admitted = await self._admit(header) if self._admit is not None else None
            claim = Claim(header.node_id, peer, network, admitted is not None and admitted.established)
            why_not = await self.slots.acquire(claim, self.config.handoff_slot_wait_s)
            if why_not is not None:
                raise HandoffBusy(f"no receive slot: {why_not}", self.config.handoff_slot_wait_s)
            try:
                self._check_cooldown(header.node_id, peer)  # cut off while this stream waited for the slot
                await asyncio.wait_for(write_frame(writer, {"go": True}), self._timeout_s)
                data = await self._read_body(header, peer, network, reader)
            finally:
                await self.slots.release(claim)  # for the body only: hashing and accepting are ours
            digest = await asyncio.to_thread(_hash_and_store, data, self.directory, header)
            if digest != header.sha256:
                raise HandoffRefused(f"the file's SHA-256 is {digest}, not the signed {header.sha256}")
            received = ReceivedRollout(header, self.stored_path(*delivery), peer, header.size)
            await self._run_accept(received)
            accepted = True
            self.cooldowns.completed(header.node_id, peer)
            return {"receipt": self._receipt(header).model_dump(mode="json")}
        finally:
            self._in_progress.discard(delivery)
            if not accepted and admitted is not None and admitted.abandon is not None:
                admitted.abandon()  # its admission place is free again at once, not when it would lapse

    def _check_cooldown(self, node_id: str, peer: str) -> None:
        wait = self.cooldowns.remaining(node_id, peer)
        if wait > 0:
            raise HandoffBusy(
                f"cooling down after a hand-off cut off for being too slow; retry in {wait:.0f} s", wait
            )

    async def _read_body(
        self, header: RolloutEnvelope, peer: str, network: str | None, reader: asyncio.StreamReader
    ) -> bytes:
        # Reading chunk by chunk is the back-pressure: the sender's writes wait on the stream window.
        try:
            return await read_at_rate(
                reader,
                header.size,
                chunk=CHUNK_BYTES,
                min_bytes_per_s=self.config.handoff_min_bytes_per_s,
                window_s=self.config.handoff_rate_window_s,
                deadline_s=body_deadline_s(self.config, header.size),
            )
        except HandoffTooSlow as exc:
            self.cut_off += 1
            cooldown = self.cooldowns.strike(header.node_id, peer)
            logger.warning(
                "cut off the hand-off of %s… from node %s… (peer %s, network %s): %s; "
                "its next hand-off waits %.0f s",
                header.sha256[:16],
                header.node_id[:16],
                peer,
                network or "not grouped",
                exc,
                cooldown,
            )
            raise HandoffBusy(f"cut off: {exc}; retry after the cooldown", cooldown) from None

    async def _run_accept(self, received: ReceivedRollout) -> None:
        try:
            outcome = self._accept(received)
            if inspect.isawaitable(outcome):
                await outcome
        except BaseException:
            received.path.unlink(missing_ok=True)  # refused or crashed: it must not look received
            self._envelope_path(received.envelope.sha256, received.envelope.node_id).unlink(missing_ok=True)
            raise

    def _receipt(self, header: RolloutEnvelope) -> Receipt:
        body = ReceiptBody(
            sha256=header.sha256,
            sender=header.node_id,
            receiver=self.identity.node_id,
            size=header.size,
            received_at=time.time(),
        )
        return Receipt(body=body, signature=self.identity.sign_document(body.model_dump(mode="json")).hex())


async def send(
    open_stream: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]],
    envelope: RolloutEnvelope,
    data: bytes,
    receiver: str,
    timeout_s: float,
    body_deadline_s: float,
) -> Receipt:
    """Hand `data` to the validator whose node id is `receiver`; returns its verified receipt.

    `timeout_s` bounds each control step (opening the stream, each answer); `body_deadline_s` the whole body,
    on the wall clock: a per-write timeout would let a validator that drains one chunk just in time hold
    the hand-off for the chunk count times the timeout."""
    if len(data) != envelope.size:
        raise HandoffError(f"the envelope signs {envelope.size} bytes but the file has {len(data)}")
    try:
        reader, writer = await asyncio.wait_for(open_stream(), timeout_s)
    except TimeoutError:
        raise HandoffError(f"could not open a stream to the validator within {timeout_s:.0f} s") from None
    try:
        await write_frame(writer, envelope.model_dump(mode="json"))
        answer = await read_frame(reader, MAX_CONTROL_FRAME, timeout_s)
        if isinstance(answer, dict) and answer.get("go") is True:
            try:
                await asyncio.wait_for(_write_body(writer, data), body_deadline_s)
            except TimeoutError:
                raise HandoffError(
                    f"the validator did not take the {len(data)}-byte body within its deadline of "
                    f"{body_deadline_s:.1f} s"
                ) from None
            answer = await read_frame(reader, MAX_CONTROL_FRAME, timeout_s)
    except (TimeoutError, OSError, ConnectionError) as exc:
        raise HandoffError(f"the hand-off stream broke: {exc!r}") from None
    finally:
        close_writer(writer)
    if isinstance(answer, dict) and isinstance(answer.get("refused"), str):
        raise HandoffRefused(answer["refused"][:500])
    if isinstance(answer, dict) and isinstance(answer.get("busy"), str):
        hint = answer.get("retry_after_s")
        numeric = isinstance(hint, (int, float)) and not isinstance(hint, bool)
        # NaN fails both comparisons.
        wait = float(hint) if numeric and 0 <= hint <= MAX_BUSY_WAIT_S else 0.0  # type: ignore[operator,arg-type]
        raise HandoffBusy(answer["busy"][:500], wait)
    if not isinstance(answer, dict) or "receipt" not in answer:
        raise HandoffError("the validator answered neither a receipt nor a refusal")
    receipt = parse_receipt(answer["receipt"])
    receipt.verify(receiver, envelope.sha256, envelope.node_id)
    return receipt


async def _write_body(writer: asyncio.StreamWriter, data: bytes) -> None:
    # Chunk by chunk, waiting on the stream's flow control: the receiver's reads are the back-pressure.
    view = memoryview(data)
    for offset in range(0, len(view), CHUNK_BYTES):
        writer.write(view[offset : offset + CHUNK_BYTES])
        await writer.drain()
