"""Length-prefixed JSON frames on libp2p streams, with a size bound and a timeout on every read."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from ..signing import canonical_json
from ..wire import WireFormatError, loads_strict
from .errors import HandoffError

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
    except asyncio.TimeoutError:
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


async def read_exactly(reader: asyncio.StreamReader, size: int, timeout: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(size), timeout)
    except asyncio.TimeoutError:
        raise HandoffError(f"peer stalled for {timeout:.0f} s") from None
    except asyncio.IncompleteReadError as exc:
        raise HandoffError(f"peer closed the stream after {len(exc.partial)} of {size} bytes") from None


def close_writer(writer: asyncio.StreamWriter) -> None:
    # p2pd streams are unix sockets to the daemon; closing twice or after a reset is harmless.
    try:
        writer.close()
    except (OSError, RuntimeError):
        pass
