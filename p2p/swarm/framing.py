"""Length-prefixed JSON frames on libp2p streams, with a size bound and a timeout on every read; raw bodies
read at a rate floor and within a deadline."""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

from ..rate_floor import RateFloor
from ..signing import canonical_json
from ..wire import WireFormatError, loads_strict
from .errors import HandoffError, HandoffTooSlow

_LEN = struct.Struct(">I")


async def write_frame(writer: asyncio.StreamWriter, document: Any) -> None:
    payload = canonical_json(document)
    writer.write(_LEN.pack(len(payload)) + payload)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, max_bytes: int, timeout: float) -> Any:
    """One JSON frame; HandoffError when it is late, truncated, larger than `max_bytes` or not JSON."""
    try:
        (length,) = _LEN.unpack(await asyncio.wait_for(reader.readexactly(_LEN.size), timeout))
        if length > max_bytes:
            raise HandoffError(f"peer sent a {length}-byte frame; at most {max_bytes} allowed")
        payload = await asyncio.wait_for(reader.readexactly(length), timeout)
    except TimeoutError:
        raise HandoffError(f"peer sent nothing for {timeout:.0f} s") from None
    except asyncio.IncompleteReadError:
        raise HandoffError("peer closed the stream mid-frame") from None
    return decode_frame(payload)


def decode_frame(payload: bytes) -> Any:
    """A frame's JSON, strictly (p2p/wire.py loads_strict): NaN, infinities and duplicate keys are refused."""
    try:
        return loads_strict(payload, "frame")
    except WireFormatError as exc:
        raise HandoffError(f"peer sent a frame that is not strict JSON: {exc}") from None


async def read_at_rate(
    reader: asyncio.StreamReader,
    size: int,
    *,
    chunk: int,
    min_bytes_per_s: float,
    window_s: float,
    deadline_s: float,
) -> bytes:
    """Exactly `size` bytes, while they keep coming at `min_bytes_per_s` and all arrive within `deadline_s`.

    The floor is p2p/rate_floor.py's, the one every body from a peer keeps. HandoffTooSlow when the sender
    falls below the floor or passes the deadline. A stream that ends early (closed or reset) is HandoffTooSlow
    too when it ended below the floor (RateFloor.ended_below: closing just before each window ends would
    otherwise hold the reader for free); one that was keeping the floor when it broke is a plain HandoffError.
    """
    start = time.monotonic()
    deadline = start + deadline_s
    floor = RateFloor(min_bytes_per_s, window_s, start)
    buffer = bytearray()
    while len(buffer) < size:
        due = min(floor.due(), deadline)
        try:
            piece = await asyncio.wait_for(
                reader.read(min(chunk, size - len(buffer))), max(0.0, due - time.monotonic())
            )
        except TimeoutError:
            piece = None
        except (OSError, ConnectionError):  # the stream was reset: judged as a close
            piece = b""
        now = time.monotonic()
        if piece == b"":
            _ended_early(len(buffer), size, floor.ended_below(now, len(buffer)))
        buffer += piece or b""
        if len(buffer) >= size:
            break
        slow = floor.check(now, len(buffer))
        if slow is not None:
            raise HandoffTooSlow(f"{slow} ({len(buffer)} of {size} bytes received)")
        if now >= deadline:
            raise HandoffTooSlow(
                f"sent {len(buffer)} of {size} bytes in {now - start:.1f} s; the deadline for a file of this "
                f"size is {deadline_s:.1f} s"
            )
    return bytes(buffer)


def _ended_early(received: int, size: int, below_floor: str | None) -> None:
    """Raise for a body that ended after `received` of `size` bytes: a cut when it ended below the floor,
    else a plain transport failure."""
    if below_floor is not None:
        raise HandoffTooSlow(f"closed the stream after {received} of {size} bytes, {below_floor}")
    raise HandoffError(f"peer closed the stream after {received} of {size} bytes")


def close_writer(writer: asyncio.StreamWriter) -> None:
    # p2pd streams are unix sockets to the daemon; closing twice or after a reset is harmless.
    try:
        writer.close()
    except (OSError, RuntimeError):
        pass
