"""A slow hand-off sender: a real swarm peer that speaks the rollout hand-off over libp2p and drips its body.

Used by the slow hand-off tests and benchmarks/slow_handoff.py. It writes exactly what Swarm.send_rollout
writes (the signed envelope, then the body), only slowly: `bytes_per_s` in pieces, so the validator's receive
slot is held for as long as the validator lets it; or, with `hang_up_after_s`, until it hangs up itself (a
sender that closes just before its window ends, to open the next stream at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import PeerID

from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import HandoffError, RolloutEnvelope, Swarm
from prime_node.p2p.swarm.framing import close_writer, read_frame, write_frame
from prime_node.p2p.swarm.handoff import MAX_CONTROL_FRAME, protocol_name


@dataclass
class Drip:
    """How one slow hand-off ended."""

    answer: Any  # the validator's answer to the header: {"go": true}, {"busy": ...}, {"refused": ...}
    final: Any = None  # what it said once the body stopped: a receipt, or the busy answer of a cut
    sent: int = 0  # body bytes written
    held_s: float | None = None  # from "go" until the validator ended the exchange (None: no "go")

    @property
    def went(self) -> bool:
        return isinstance(self.answer, dict) and self.answer.get("go") is True

    def busy_reason(self) -> str:
        for frame in (self.final, self.answer):
            if isinstance(frame, dict) and isinstance(frame.get("busy"), str):
                return frame["busy"]
        return ""


def signed_blob(identity: Identity, size: int) -> tuple[bytes, RolloutEnvelope]:
    """Random bytes of `size`, signed as a rollout file (opaque to the hand-off: never parsed when cut)."""
    data = os.urandom(size)
    return data, RolloutEnvelope.sign(identity, data, (0, 0))  # routed by its signed batch


async def drip(
    sender: Swarm,
    validator_peer_id: str,
    data: bytes,
    envelope: RolloutEnvelope,
    *,
    bytes_per_s: float,
    piece: int = 16 * 1024,
    limit_s: float = 60.0,
    on_go: Callable[[], None] | None = None,
    hang_up_after_s: float | None = None,
) -> Drip:
    """Hand `data` to the validator at `bytes_per_s` (0: nothing); returns when the validator ends it, at
    `limit_s`, or when this sender closes the stream `hang_up_after_s` after "go"."""
    assert sender._p2p is not None
    _, reader, writer = await sender._p2p.call_binary_stream_handler(
        PeerID.from_base58(validator_peer_id), protocol_name(sender.config.run_id)
    )
    try:
        await write_frame(writer, envelope.model_dump(mode="json"))
        result = Drip(answer=await read_frame(reader, MAX_CONTROL_FRAME, limit_s))
        if not result.went:
            return result
        went_at = time.monotonic()
        if on_go is not None:
            on_go()

        async def pump() -> None:
            while bytes_per_s > 0 and result.sent < len(data):
                chunk = data[result.sent : result.sent + piece]
                writer.write(chunk)
                await writer.drain()
                result.sent += len(chunk)
                await asyncio.sleep(len(chunk) / bytes_per_s)

        pumping = asyncio.create_task(pump(), name="drip-pump")
        try:
            result.final = await read_frame(reader, MAX_CONTROL_FRAME, hang_up_after_s or limit_s)
        except HandoffError:  # closed without an answer, or still open at limit_s (or at the hang-up)
            result.final = None
        finally:
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, ConnectionError):
                await pumping
        result.held_s = time.monotonic() - went_at
        return result
    finally:
        close_writer(writer)
