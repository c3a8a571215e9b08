"""Pipeline hops over libp2p: a 2-stage group whose stages run in two processes, each with its own hivemind
DHT node on 127.0.0.1, generates bit-identically to a monolithic engine, and its stage records verify; a
stranger dialling either stage is refused before a byte is read, and the group's next batches are untouched."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from prime_node.node.engine.hf import HFEngine
from prime_node.node.pipeline.boundaries import BoundaryOracle
from prime_node.node.pipeline.group import HopSettings
from prime_node.node.pipeline.hops import SwarmHops
from prime_node.node.pipeline.host import BatchDone, StageHost
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.errors import PipelineWireError
from prime_node.p2p.pipeline.group_ids import new_nonce
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.pipeline.libp2p import ACK, StageStreams, StreamLimits, protocol_name, transport_addresses
from prime_node.p2p.pipeline.transport import ROUTE_BYTES, Route
from prime_node.p2p.processes import end_pids
from prime_node.p2p.swarm.group_records import GroupRecord, group_id
from prime_node.proofs.pipeline.blame import GroupWork, verify_group
from prime_node.proofs.pipeline.records import GroupSpec, SignedStageRecord

from support.pipeline import save_tiny
from support.stage_process import MICRO_BATCH, PARAMS, work_for
from support.swarm import fleet, wait_until

RUN = "pipenet"
LAYOUT = StageLayout(boundaries=[0, 2, 4])
STEP = 3
BATCHES = 3  # at least: batch 0 before the strangers dial, two after they did
FAST = dict(heartbeat_interval_s=0.5, heartbeat_ttl_s=20.0, record_ttl_s=60.0)
CHILD_DEADLINE_S = 150.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-libp2p"))


def test_routes_are_fixed_size_and_strict() -> None:
    route = Route("ab" * 32, 7, 1)
    assert len(route.encode()) == ROUTE_BYTES and Route.decode(route.encode()) == route
    with pytest.raises(PipelineWireError, match="route is 41 bytes"):
        Route.decode(route.encode()[:-1])
    with pytest.raises(PipelineWireError, match="out of range"):
        Route.decode(route.encode()[:-1] + bytes([200]))
    rng = random.Random(5)
    for _ in range(2000):  # any bytes: a route or a PipelineWireError, never anything else
        raw = rng.randbytes(rng.choice([ROUTE_BYTES, ROUTE_BYTES, rng.randrange(0, 100)]))
        try:
            decoded = Route.decode(raw)
        except PipelineWireError:
            continue
        assert decoded.encode() == raw and 0 <= decoded.stage < 64 and 0 <= decoded.batch < 1 << 63


@pytest.fixture
async def daemons() -> AsyncIterator[list[P2P]]:
    """Three bare libp2p daemons on 127.0.0.1 (no DHT): a stage's node, its group's member, a stranger."""
    started: list[P2P] = []
    try:
        for _ in range(3):
            started.append(await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        yield started
    finally:
        for daemon in started:
            await daemon.shutdown()


async def _open(dialler: P2P, target: P2P) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    addresses = [str(a) for a in await target.get_visible_maddrs()]
    await dialler._client.connect(target.peer_id, transport_addresses(addresses))
    _, reader, writer = await dialler.call_binary_stream_handler(target.peer_id, protocol_name(RUN))
    return reader, writer


async def test_a_stage_endpoint_refuses_strangers_unread_and_bounds_what_members_hold(
    daemons: list[P2P],
) -> None:
    node, member_p2p, stranger = daemons
    limits = StreamLimits(route_timeout_s=30.0, hold_s=30.0, max_held_per_peer=2, retry_s=0.05)
    streams = StageStreams(node, RUN, limits)
    await node.add_binary_stream_handler(streams.name, streams.handle)
    member = StageStreams(member_p2p, RUN, limits)
    group = "ab" * 32
    streams.admit(group, 1, member_p2p.peer_id.to_base58())
    addresses = [str(a) for a in await node.get_visible_maddrs()]
    node_id = node.peer_id.to_base58()

    # A stranger that sends nothing is refused at once: the stage never waited for (or read) its route, which
    # it would have for up to 30 s.
    started = time.monotonic()
    reader, writer = await _open(stranger, node)
    assert await asyncio.wait_for(reader.read(1), 10.0) == b""
    writer.close()
    assert time.monotonic() - started < 5.0
    await wait_until(lambda: _now(len(streams.refusals) == 1), timeout=10.0, interval=0.05)
    assert [why for _, _, why in streams.refusals] == [
        "not the member a group of this node names as its predecessor"
    ]

    # The member: a route naming a stage it is not admitted to, and a route cut short, are refused.
    reader, writer = await _open(member_p2p, node)
    writer.write(Route(group, 0, 0).encode())
    assert await asyncio.wait_for(reader.read(1), 10.0) == b""
    writer.close()
    reader, writer = await _open(member_p2p, node)
    writer.write(Route(group, 0, 1).encode()[:20])
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(1), 10.0) == b""
    writer.close()
    await wait_until(lambda: _now(len(streams.refusals) == 3), timeout=10.0, interval=0.05)
    reasons = [why for _, _, why in streams.refusals][1:]
    assert reasons[0].startswith("not admitted to stage 0 of group abab")
    assert reasons[1] == "closed after 20 of the 41 route bytes"

    # Streams for batches no stage asked for yet are held, two at most; the follower takes the newest and the
    # older one is closed as stale.
    held = [await member.dial(node_id, addresses, Route(group, b, 1), timeout_s=10.0) for b in (5, 6)]
    with pytest.raises(PipelineWireError, match="refused"):
        await member.dial(node_id, addresses, Route(group, 7, 1), timeout_s=1.0)
    assert "already holds 2 streams" in streams.refusals[-1][2]
    inbound = streams.inbound(Route(group, 3, 1), follow=True)
    await inbound.accepted(5.0)
    assert inbound.route == Route(group, 6, 1)
    assert await asyncio.wait_for(held[0][0].read(1), 10.0) == b""  # batch 5: closed
    held[1][1].write(b"frames")
    await held[1][1].drain()
    received, _ = await inbound.accepted(5.0)
    assert await asyncio.wait_for(received.readexactly(6), 10.0) == b"frames"
    inbound.close()
    assert await asyncio.wait_for(held[1][0].read(1), 10.0) == b""

    # A dial to a stage that does not wait for it yet is retried until the stage's node admits its sender.
    later = "cd" * 32
    dialled = asyncio.create_task(member.dial(node_id, addresses, Route(later, 0, 1), timeout_s=20.0))
    await asyncio.sleep(0.5)
    assert not dialled.done()
    streams.admit(later, 1, member_p2p.peer_id.to_base58())
    reader, writer = await asyncio.wait_for(dialled, 20.0)
    writer.close()
    streams.close()


async def _raw_stranger_stream(stranger: StageStreams, peer_id: str, route: Route) -> tuple[bytes, float]:
    """A stranger opens a stream to the stage's protocol, sends a well-formed route and a megabyte, and
    reads the answer: (what it got before the stream closed, seconds it took)."""
    started = time.monotonic()
    _, reader, writer = await stranger.p2p.call_binary_stream_handler(
        PeerID.from_base58(peer_id), protocol_name(RUN)
    )
    try:
        writer.write(route.encode() + bytes(1 << 20))
        answer = await asyncio.wait_for(reader.read(1), 10.0)
    except (OSError, ConnectionError):
        answer = b""
    finally:
        writer.close()
    return answer, time.monotonic() - started


async def test_two_processes_generate_like_one_engine_and_strangers_are_refused(
    model_dir: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    engine = HFEngine.load(model_dir, dtype="float32", max_batch_size=MICRO_BATCH)
    work = work_for(engine.eos_token_id, engine.pad_token_id)
    operator = Identity.generate()
    first_id, second_id = Identity.from_seed(b"\x11" * 32), Identity.from_seed(b"\x12" * 32)
    members = [first_id.node_id, second_id.node_id]
    formed_at = time.time()
    nonce = new_nonce(formed_at)  # as the coordinator draws it for a new group
    group = GroupRecord(
        group_id=group_id(RUN, STEP, members, LAYOUT, nonce),
        round=1,
        policy_step=STEP,
        layout=LAYOUT,
        members=members,
        formed_at=formed_at,
        signed_at=time.time(),
        nonce=nonce,
    )
    done: list[BatchDone] = []
    done_at: list[float] = []
    child: subprocess.Popen[bytes] | None = None
    async with fleet(RUN, operator) as swarm:
        coordinator = await swarm.add(operator, roles=("trainer",), **FAST)
        first = await swarm.add(first_id, **FAST)
        stranger = await swarm.add(**FAST)
        stranger_peer = stranger.peer_id
        first.policy_step = STEP
        spec = {
            "run_id": RUN,
            "operator": operator.node_id,
            "bootstrap": await swarm.bootstrap(),
            "seed": (b"\x12" * 32).hex(),
            "model_dir": str(model_dir),
            "boundaries": LAYOUT.boundaries,
            "policy_step": STEP,
            "eos": engine.eos_token_id,
            "pad": engine.pad_token_id,
            "batches": BATCHES,
            "deadline_s": CHILD_DEADLINE_S - 10,
        }
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        out = tmp_path / "out.json"
        script = Path(__file__).parent / "support" / "stage_process.py"
        log = (tmp_path / "child.log").open("wb")
        child = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "spec.json"), str(out)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdin=subprocess.PIPE,  # closed when the test has seen enough: the child then stops
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        host: StageHost | None = None
        try:
            streams = await first.serve_pipeline()
            stranger_streams = await stranger.serve_pipeline(StreamLimits(retry_s=0.05))

            async def on_batch(result: BatchDone) -> None:
                done.append(result)
                done_at.append(time.monotonic())

            host = StageHost(
                first_id,
                RUN,
                model_dir,
                LAYOUT,
                work,
                SwarmHops(streams, first.pipeline_peer),
                HopSettings(frame_timeout_s=20.0, connect_timeout_s=20.0),
                on_batch,
            )
            assert await coordinator.publish_group(group)
            # Stage 0 may start before the child has even joined: its dial is retried until its deadline.
            await host.on_change(group, "named by the operator's group record")
            await wait_until(lambda: _now(len(done) >= 1), timeout=120.0, interval=0.1)

            # Strangers, while the group runs: a well-formed dial through the pipeline endpoint, and a raw
            # stream sending a route and a megabyte. Both stages refuse them unread; no acknowledgement.
            second_peer = await first.pipeline_peer(second_id.node_id)
            assert second_peer is not None
            for peer_id, addresses, stage in (
                (first.peer_id, await first.maddrs(), 0),
                (second_peer[0], second_peer[1], 1),
            ):
                route = Route(group.group_id, len(done) + 1, stage)
                await wait_until(
                    partial(_connect, stranger_streams, peer_id, addresses), timeout=60.0, interval=1.0
                )
                with pytest.raises(PipelineWireError, match=r"took no stream within 1\.0 s \(refused"):
                    await stranger_streams.dial(peer_id, addresses, route, timeout_s=1.0)
                answer, took = await _raw_stranger_stream(stranger_streams, peer_id, route)
                assert answer != ACK and answer == b"", answer
                assert took < 5.0
            refused_here = [why for _, peer, why in streams.refusals if peer == stranger.peer_id]
            assert refused_here and all("not the member" in why for why in refused_here)
            assert not [p for _, p, _ in streams.refusals if p != stranger.peer_id]

            # The group goes on as if nothing happened: two more batches after the strangers, then the child
            # stops and reports.
            attacked_at = len(done)
            await wait_until(lambda: _now(len(done) >= attacked_at + 2), timeout=60.0, interval=0.1)
            assert child.stdin is not None
            abandoned_before, stopped_at, stopped_wall = len(host.abandoned), time.monotonic(), time.time()
            child.stdin.close()
            child_exit = await asyncio.to_thread(child.wait, CHILD_DEADLINE_S)
            assert child_exit == 0, (tmp_path / "child.log").read_text()[-4000:]
            # Stage 0 ends a batch when it reads the last stage's end frame, sent before the child recorded it.
            await wait_until(
                lambda: _now(len(done) >= len(json.loads(out.read_text())["batches"])),
                timeout=30.0,
                interval=0.1,
            )
            # The batch stage 0 had in flight when its peer left is abandoned within the hop's deadlines.
            await wait_until(
                lambda: _now(len(host.abandoned) > abandoned_before), timeout=30.0, interval=0.05
            )
            left_in = time.monotonic() - stopped_at
        finally:
            if host is not None:
                await host.stop()
            if child is not None and child.poll() is None:
                end_pids([child.pid], 3.0)
            log.close()

    result = json.loads(out.read_text())
    print(
        f"2-stage group across two processes over libp2p: {len(done)} batches of 4 samples x 8 tokens, "
        f"{(done_at[-1] - done_at[0]) / (len(done_at) - 1) * 1000:.0f} ms per batch after the first; stage 1 told "
        f"to stop -> stage 0's batch in flight abandoned in {left_in:.2f} s"
    )
    assert result["peer_id"] == second_peer[0]
    refused_there = [why for _, peer, why in result["refusals"] if peer == stranger_peer]
    assert refused_there and all("not the member" in why for why in refused_there)
    # The member was never refused while the group stood: from the child's first batch (before it, stage 0 may
    # dial a child that has not yet read the group record, and retries) until it left (then stage 0 is a
    # stranger there).
    stood_from = result["first_batch_wall"]
    assert stood_from is not None
    assert not [
        (at, why)
        for at, peer, why in result["refusals"]
        if peer != stranger_peer and stood_from <= at < stopped_wall
    ], result["refusals"]
    # Stage 0 numbers the batches (those it ran before the child joined were abandoned); the child follows from
    # the first one it was offered, and loses none after that.
    ran = [b["batch"] for b in result["batches"]]
    assert ran == list(range(ran[0], ran[0] + len(ran))), result["abandoned"]
    assert len(result["batches"]) >= attacked_at + 2
    oracle = BoundaryOracle(engine.model, LAYOUT)
    ours = {d.batch: d for d in done}
    for produced in result["batches"]:
        batch_work = work(group, produced["batch"])
        reference = engine.generate(batch_work.requests, PARAMS, capture_hidden=False)
        assert len(produced["completions"]) == len(reference)
        for got, want in zip(produced["completions"], reference):
            assert tuple(got["output_ids"]) == want.output_ids
            assert tuple(got["logprobs"]) == want.output_logprobs  # bit-identical float32 across processes
            assert got["finish"] == want.finish_reason
        # The two processes' stage records verify together, as a validator would check them.
        records = [ours[produced["batch"]].record, SignedStageRecord.model_validate(produced["record"])]
        gspec = GroupSpec(RUN, STEP, produced["batch"], LAYOUT, tuple(members), group.nonce)
        gwork = GroupWork(
            [r.prompt_ids for r in batch_work.requests],
            [r.seed for r in batch_work.requests],
            PARAMS.temperature,
            PARAMS.max_new_tokens,
            engine.eos_token_id,
            MICRO_BATCH,
        )
        verdict = verify_group(gspec, records, gwork, oracle)
        assert verdict.accepted, verdict.reason


async def _connect(streams: StageStreams, peer_id: str, addresses: list[str]) -> bool:
    """Whether the stranger's daemon connected to the peer. Done before its short dials, with retries: its DHT
    may have tried the peer before it listened (libp2p then backs off for a while), and a dial cut short by a
    short deadline would only put the peer in that backoff."""
    try:
        await asyncio.wait_for(
            streams.p2p._client.connect(PeerID.from_base58(peer_id), transport_addresses(addresses)), 10.0
        )
    except (TimeoutError, ControlFailure):
        return False
    return True


async def _now(value: bool) -> bool:
    return value
