"""What a node measures before offering stages: layer throughput of a real stage, TCP round trips to peers."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

from prime_node.node.pipeline.offer import measure_layer_throughput, measure_rtts, tcp_endpoint
from prime_node.node.pipeline.stage_model import StageModel
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.swarm.group_records import MAX_THROUGHPUT
from prime_node.p2p.swarm.records import Hardware, Heartbeat

from support.pipeline import save_tiny

LAYOUT = StageLayout(boundaries=[0, 1, 4])


def beat(node: str, addresses: list[str]) -> Heartbeat:
    return Heartbeat(
        node_id=node,
        peer_id="12D3KooWLtPGnEYZ57XxMm1XZVfb9vLStjt5xvxMGaYtTKhRbtFK",
        version="0.1.0",
        roles=["contributor"],
        hardware=Hardware(),
        addresses=addresses,
        client_mode=False,
        policy_step=None,
        serves_steps=[],
        sent_at=1.0,
    )


def test_throughput_is_measured_on_the_stage_and_priced_per_layer(
    tmp_path: Path, one_torch_thread: None
) -> None:
    model_dir = save_tiny(tmp_path / "tiny")
    first = measure_layer_throughput(StageModel.load(model_dir, LAYOUT, 0))
    rest = measure_layer_throughput(StageModel.load(model_dir, LAYOUT, 1))
    for value in (first, rest):
        assert math.isfinite(value) and 0 < value <= MAX_THROUGHPUT


def test_only_ip4_tcp_addresses_are_dialled() -> None:
    node = Identity.from_seed(b"\x05" * 32).node_id
    assert tcp_endpoint(beat(node, ["/ip6/::1/tcp/5", "/ip4/127.0.0.1/tcp/4001/p2p/Qm"])) == (
        "127.0.0.1",
        4001,
    )
    assert tcp_endpoint(beat(node, ["/ip4/127.0.0.1/udp/4001/quic", "/ip4/1.2.3.4/tcp/0"])) is None
    assert tcp_endpoint(beat(node, [])) is None


async def test_round_trips_are_measured_to_listening_peers_and_bounded() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    closed = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    dead_port = closed.sockets[0].getsockname()[1]
    closed.close()
    await closed.wait_closed()
    me, up, down = (Identity.from_seed(bytes([9 + i]) * 32).node_id for i in range(3))
    beats = {
        me: beat(me, [f"/ip4/127.0.0.1/tcp/{port}"]),
        up: beat(up, [f"/ip4/127.0.0.1/tcp/{port}"]),
        down: beat(down, [f"/ip4/127.0.0.1/tcp/{dead_port}"]),
    }
    try:
        (rtt,) = await measure_rtts(me, beats, timeout_s=1.0)
    finally:
        server.close()
    assert rtt.node_id == up and 0 <= rtt.rtt_ms < 1000
