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
The envelope is the one proofs/rollout_file.py writes beside each file (FILE.parquet.sig). A received file is
one sender's delivery, stored as `<sha256>-<node_id>.parquet` (`stored_name`): the same bytes signed by two
nodes (one re-signing the other's file) are two deliveries, and neither answers for the other.
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
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, ValidationError

from ..identity import Identity
from ..signing import SignatureError, verify_document
from ..wire import Timestamp, WireModel, describe
from .config import SwarmConfig
from .errors import HandoffBusy, HandoffError, HandoffRefused, HandoffTooSlow
from .framing import close_writer, read_at_rate, read_frame, write_frame
from .records import NodeId, Sha256Hex
from .slots import Claim, Cooldowns, SlotTable, network_of

logger = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024
SIG_FORMAT = "prime-node/rollout-sig/v1"
FILE_SUFFIX = ".parquet"
ENVELOPE_SUFFIX = ".parquet.sig"  # the envelope beside each received file, as proofs/rollout_file.py names it
MAX_CONTROL_FRAME = 4096
SignatureHex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{128}$")]


def protocol_name(run_id: str) -> str:
    return f"/prime-node/{run_id}/rollout/1"


class RolloutEnvelope(WireModel):
    """The detached signature envelope of a rollout file, exactly as proofs/rollout_file.py writes it."""

    format: Literal["prime-node/rollout-sig/v1"] = SIG_FORMAT
    node_id: NodeId  # the author, whose key signs
    sha256: Sha256Hex  # of the file's bytes
    size: int = Field(ge=0, le=1 << 40)  # of the file, in bytes
    signature: SignatureHex  # Ed25519 by node_id over canonical JSON of the four fields above

    def signed_body(self) -> dict[str, Any]:
        return {"format": self.format, "node_id": self.node_id, "sha256": self.sha256, "size": self.size}

    @classmethod
    def sign(cls, identity: Identity, data: bytes) -> RolloutEnvelope:
        sha256 = hashlib.sha256(data).hexdigest()
        body = {"format": SIG_FORMAT, "node_id": identity.node_id, "sha256": sha256, "size": len(data)}
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


@dataclass(frozen=True)
class Admitted:
    """What the validator's admission says of a header it let through."""

    established: bool  # the sender has accepted work here: it may use the reserved receive slots
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
        self._in_progress: set[tuple[str, str]] = set()  # (file hash, sender) being received

    def stored_path(self, sha256: str, node_id: str) -> Path:
        return self.directory / f"{stored_name(sha256, node_id)}{FILE_SUFFIX}"

    def _envelope_path(self, sha256: str, node_id: str) -> Path:
        return self.directory / f"{stored_name(sha256, node_id)}{ENVELOPE_SUFFIX}"

    def body_deadline_s(self, size: int) -> float:
        """The longest a body of `size` bytes may hold a receive slot: grace plus its size at the floor."""
        return self.config.handoff_deadline_grace_s + size / self.config.handoff_min_bytes_per_s

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
        delivery = (header.sha256, header.node_id)
        if self.stored_path(*delivery).exists():
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
                deadline_s=self.body_deadline_s(header.size),
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
) -> Receipt:
    """Hand `data` to the validator whose node id is `receiver`; returns its verified receipt."""
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
            view = memoryview(data)
            for offset in range(0, len(view), CHUNK_BYTES):
                writer.write(view[offset : offset + CHUNK_BYTES])
                await asyncio.wait_for(writer.drain(), timeout_s)
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
        valid = numeric and 0 <= hint <= MAX_BUSY_WAIT_S  # NaN fails both comparisons
        raise HandoffBusy(answer["busy"][:500], float(hint) if valid else 0.0)
    if not isinstance(answer, dict) or "receipt" not in answer:
        raise HandoffError("the validator answered neither a receipt nor a refusal")
    receipt = parse_receipt(answer["receipt"])
    receipt.verify(receiver, envelope.sha256, envelope.node_id)
    return receipt
