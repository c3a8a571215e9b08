"""One pipeline hop's bulk throughput and round trip: libp2p (StageStreams between two hivemind p2p daemons on
127.0.0.1) against asyncio TCP on 127.0.0.1, in one run (docs/pipeline.md, "Transport").

Usage: .venv/bin/python benchmarks/pipeline_transport.py [--mib 256] [--chunk-kib 1024] [--pings 200]

Bulk: the dialler writes --mib MiB in --chunk-kib chunks (an activation frame of a real model is 1-32 MiB); the
receiver reads it all; wall-clock MiB/s from the first write to the last byte read. Round trip: --pings one-byte
echoes on the same kind of stream (a decode step's small frames are latency-bound); median microseconds.
Both sides run in this process, so the numbers include both ends' Python and, for libp2p, both daemons'.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hivemind.p2p import P2P  # noqa: E402

from prime_node.p2p.pipeline.libp2p import StageStreams, StreamLimits  # noqa: E402
from prime_node.p2p.pipeline.transport import Route, StreamPair  # noqa: E402

GROUP = "ab" * 32


async def _bulk(sender: StreamPair, receiver: StreamPair, total: int, chunk: int) -> float:
    data = bytes(chunk)

    async def write() -> None:
        for _ in range(total // chunk):
            sender[1].write(data)
            await sender[1].drain()

    started = time.perf_counter()
    writing = asyncio.create_task(write(), name="bench-write")
    received = 0
    while received < total:  # chunk by chunk, as a frame reader's tensor reads; nothing kept
        got = await receiver[0].read(chunk)
        if not got:
            raise EOFError(f"the stream closed after {received} of {total} bytes")
        received += len(got)
    await writing
    return total / (1 << 20) / (time.perf_counter() - started)


async def _pings(sender: StreamPair, receiver: StreamPair, count: int) -> float:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        sender[1].write(b"x")
        await sender[1].drain()
        await receiver[0].readexactly(1)
        receiver[1].write(b"y")
        await receiver[1].drain()
        await sender[0].readexactly(1)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


async def _libp2p_pair(
    batch: int, b: P2P, dialler: StageStreams, receiver: StageStreams
) -> tuple[StreamPair, StreamPair]:
    route = Route(GROUP, batch, 1)
    addresses = [str(m) for m in await b.get_visible_maddrs()]
    inbound = receiver.inbound(route)
    out = await dialler.dial(b.peer_id.to_base58(), addresses, route, timeout_s=30.0)
    return out, await inbound.accepted(30.0)


async def _tcp_pair() -> tuple[StreamPair, StreamPair, asyncio.base_events.Server]:
    accepted: asyncio.Future[StreamPair] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result((reader, writer))

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    out = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    return out, await accepted, server


async def main(args: argparse.Namespace) -> None:
    total, chunk = args.mib << 20, args.chunk_kib << 10
    a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    b = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        dialler, receiver = StageStreams(a, "bench"), StageStreams(b, "bench", StreamLimits())
        await b.add_binary_stream_handler(receiver.name, receiver.handle)
        receiver.admit(GROUP, 1, a.peer_id.to_base58())
        started = time.perf_counter()
        p2p_out, p2p_in = await _libp2p_pair(0, b, dialler, receiver)
        first_dial_ms = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        again_out, again_in = await _libp2p_pair(1, b, dialler, receiver)
        dial_ms = (time.perf_counter() - started) * 1e3
        tcp_out, tcp_in, server = await _tcp_pair()
        p2p_rate = await _bulk(p2p_out, p2p_in, total, chunk)
        tcp_rate = await _bulk(tcp_out, tcp_in, total, chunk)
        p2p_rtt = await _pings(again_out, again_in, args.pings)
        tcp_rtt = await _pings(tcp_out, tcp_in, args.pings)
        print(
            f"bulk, {args.mib} MiB in {args.chunk_kib} KiB chunks: libp2p {p2p_rate:.0f} MiB/s, "
            f"TCP {tcp_rate:.0f} MiB/s (libp2p/TCP {p2p_rate / tcp_rate:.2f})"
        )
        print(
            f"round trip, median of {args.pings}: libp2p {p2p_rtt:.0f} us, TCP {tcp_rtt:.0f} us "
            f"(libp2p/TCP {p2p_rtt / tcp_rtt:.1f}x)"
        )
        print(
            f"opening a hop (stream open, route, acknowledgement): first {first_dial_ms:.1f} ms (includes "
            f"connecting the daemons), next {dial_ms:.1f} ms"
        )
        for pair in (p2p_out, p2p_in, again_out, again_in, tcp_out, tcp_in):
            pair[1].close()
        server.close()
        receiver.close()
    finally:
        await a.shutdown()
        await b.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--chunk-kib", type=int, default=1024)
    parser.add_argument("--pings", type=int, default=200)
    asyncio.run(main(parser.parse_args()))
