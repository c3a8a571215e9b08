"""A TCP proxy that delays every byte by a fixed time in each direction: latency where tc netem is missing.

    python delay.py --listen 0.0.0.0:9000 --to 10.77.0.2:8470 --delay-ms 40

Each chunk read from one side is written to the other `delay_ms` after it arrived, in order, so a
connection through the proxy gains 2 x delay_ms of round-trip time while its throughput is kept (up to
the window of data in flight: at most QUEUED_CHUNKS chunks per direction wait, then reading pauses, which
is the back-pressure TCP would see from a long pipe). Stdlib only: it runs as a plain script in a namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

CHUNK = 64 * 1024
QUEUED_CHUNKS = 512  # 32 MiB in flight per direction at most: a 2.6 Gbit/s x 100 ms pipe
CONNECT_TIMEOUT_S = 10.0


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED_CHUNKS)

    async def read() -> None:
        while True:
            data = await reader.read(CHUNK)
            await queue.put((time.monotonic() + delay_s, data))
            if not data:
                return

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    reading = asyncio.create_task(read(), name="delay-read")
    try:
        await write()
    finally:
        reading.cancel()


async def _serve(
    inbound_r: asyncio.StreamReader, inbound_w: asyncio.StreamWriter, to: tuple[str, int], delay_s: float
) -> None:
    try:
        out_r, out_w = await asyncio.wait_for(asyncio.open_connection(*to), CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError):
        inbound_w.close()
        return
    try:
        await asyncio.gather(_pump(inbound_r, out_w, delay_s), _pump(out_r, inbound_w, delay_s))
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        for w in (inbound_w, out_w):
            w.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, type=_address, help="HOST:PORT to accept on")
    parser.add_argument("--to", required=True, type=_address, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", required=True, type=float, help="one-way delay added, each direction")
    args = parser.parse_args()
    if not 0 <= args.delay_ms <= 10_000:
        parser.error(f"--delay-ms must be between 0 and 10000, not {args.delay_ms}")
    delay_s = args.delay_ms / 1000
    server = await asyncio.start_server(lambda r, w: _serve(r, w, args.to, delay_s), *args.listen)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
