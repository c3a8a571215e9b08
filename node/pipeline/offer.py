"""What a pipeline node measures before it offers stages: its layer throughput and round trips to peers.

Throughput is measured, not declared: a decode-shaped forward of a stage this node holds, timed in process
CPU time or wall time, whichever is larger (a shared machine's wall clock flatters nobody), and priced per
layer so the coordinator can cost any stage with it. Round trips are TCP handshakes to the addresses peers
publish in their heartbeats (one SYN/SYN-ACK: one round trip, with no cooperation needed from the peer),
each bounded by a timeout, at most MAX_KNOWN_PEERS of them, the median of a few tries.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from collections.abc import Mapping

import torch

from ...p2p.swarm.group_records import MAX_KNOWN_PEERS, MAX_RTT_MS, MAX_THROUGHPUT, PeerRtt
from ...p2p.swarm.records import Heartbeat
from .stage_model import StageModel

# ASCII digits only (a regex's \d also takes other scripts' digits, which int() then reads); matched whole.
_TCP_MADDR = re.compile(r"/ip4/([0-9]{1,3}(?:\.[0-9]{1,3}){3})/tcp/([0-9]{1,5})(?:/.*)?", re.DOTALL)


def measure_layer_throughput(model: StageModel, *, tokens: int = 16, repeats: int = 3) -> float:
    """Layer-tokens per second of `model`: `tokens` one-position rows through its layers, best of `repeats`."""
    hidden = model.config.hidden_size
    best = float("inf")
    for _ in range(repeats):
        x = (
            torch.randint(0, model.config.vocab_size, (tokens, 1))
            if model.first
            else torch.zeros(tokens, 1, hidden, dtype=next(model.layers.parameters()).dtype)
        )
        positions = torch.zeros(tokens, 1, dtype=torch.long)
        wall, cpu = time.perf_counter(), time.process_time()
        model(x, None, positions, None)
        best = min(best, max(time.perf_counter() - wall, time.process_time() - cpu, 1e-9))
    return min(tokens * len(model.layers) / best, MAX_THROUGHPUT)


def tcp_endpoint(heartbeat: Heartbeat) -> tuple[str, int] | None:
    """The first /ip4/<host>/tcp/<port> address a heartbeat publishes, or None."""
    for maddr in heartbeat.addresses:
        found = _TCP_MADDR.fullmatch(maddr)
        if found and 0 < int(found.group(2)) < 65536:
            return found.group(1), int(found.group(2))
    return None


async def _handshake_ms(host: str, port: int, timeout_s: float) -> float | None:
    started = time.perf_counter()
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (TimeoutError, OSError):
        return None
    elapsed = (time.perf_counter() - started) * 1000.0
    writer.close()
    return elapsed


async def measure_rtts(
    node_id: str, heartbeats: Mapping[str, Heartbeat], *, tries: int = 3, timeout_s: float = 2.0
) -> list[PeerRtt]:
    """Median handshake time to up to MAX_KNOWN_PEERS other peers (smallest node ids first: deterministic)."""
    targets = [
        (peer, endpoint)
        for peer, beat in sorted(heartbeats.items())
        if peer != node_id and (endpoint := tcp_endpoint(beat)) is not None
    ][:MAX_KNOWN_PEERS]

    async def one(peer: str, host: str, port: int) -> PeerRtt | None:
        samples = [s for _ in range(tries) if (s := await _handshake_ms(host, port, timeout_s)) is not None]
        if not samples:
            return None
        return PeerRtt(node_id=peer, rtt_ms=min(statistics.median(samples), MAX_RTT_MS))

    found = await asyncio.gather(*(one(p, *e) for p, e in targets))
    return [r for r in found if r is not None]
