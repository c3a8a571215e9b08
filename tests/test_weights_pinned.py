"""The one pinned-checkpoint fetch (p2p/weights/pinned.py) the contributor and the validator share: only the
announced manifest is taken, a refusal backs off (doubling, capped), and following the newest pin heals when a
source comes back. Real weights servers on 127.0.0.1, real stores."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from prime_node.node.engine import EngineSettings
from prime_node.node.run.settings import RunSettings
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import PolicyAnnouncement
from prime_node.p2p.weights.availability import sign_availability
from prime_node.p2p.weights.fetch import FetchSettings
from prime_node.p2p.weights.pinned import Pin, PinnedFetch, PinRefused
from prime_node.p2p.weights.sources import SelectionSettings
from prime_node.p2p.weights.store import Store
from prime_node.trainer.validator.checkpoints import CheckpointKeeper

from support.swarm import RUN_PARAMETERS, wait_until
from support.weights import hostile, operator, publish_steps, same_tree, serving

FAST = FetchSettings(
    stall_timeout_s=1.0,
    connect_timeout_s=1.0,
    manifest_timeout_s=2.0,
    durable=False,
    max_attempts_per_shard=3,
    selection=SelectionSettings(backoff_base_s=0.02, backoff_max_s=0.1),
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_only_the_announced_manifest_is_taken_and_refusals_back_off_to_a_cap(tmp_path: Path) -> None:
    key = operator()
    manifests = publish_steps(tmp_path, key, [0, 1], megabytes=0.2)
    clock = Clock()
    store = Store(tmp_path / "node")
    pinned = PinnedFetch(store, key.node_id, FAST, retry_s=2.0, max_retry_s=5.0, clock=clock)
    async with serving(tmp_path / "origin", key.node_id) as server:
        # Step 1 announced with step 0's manifest: operator-signed, served, but not the pinned one.
        wrong = Pin(1, manifests[0].digest, (server.url,))
        delays = []
        for _ in range(3):
            with pytest.raises(PinRefused, match="step 1 refused: .*announced") as refused:
                await pinned.fetch(wrong)
            delays.append((refused.value.retry_in_s, pinned.retry_in(1)))
        assert delays == [(2.0, 2.0), (4.0, 4.0), (5.0, 5.0)]  # doubling, capped at max_retry_s
        assert 1 not in store.versions() and not store.version_dir(1).exists()
        clock.now += 5.0
        assert pinned.retry_in(1) == 0.0  # due again

        # The honest control: the announced manifest is fetched, verified, and clears the backoff.
        result = await pinned.fetch(Pin(1, manifests[1].digest, (server.url,)))
        assert same_tree(tmp_path / "origin" / "step-000000000001" / "checkpoint", result.checkpoint_dir)
        assert result.checkpoint_dir == store.checkpoint_dir(1) and pinned.retry_in(1) == 0.0

    with pytest.raises(PinRefused, match="names no sources"):
        await pinned.fetch(Pin(2, manifests[1].digest, ()))
    pinned.never_again(2)
    assert pinned.retry_in(2) == float("inf")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_the_validator_retries_an_announced_checkpoint_until_its_source_answers(tmp_path: Path) -> None:
    # Before, the validator tried each announcement once: a source down at that moment left the step unheld
    # until the next step was announced, and every file of it waited, then expired unverified.
    key = operator()
    manifests = publish_steps(tmp_path, key, [0], megabytes=0.2)
    port = _free_port()
    keeper = CheckpointKeeper(
        Store(tmp_path / "validator"),
        key.node_id,
        RunSettings(),
        EngineSettings(threads=1),
        keep=2,
        fetch=FAST,
        retry_s=0.2,
        max_retry_s=0.4,
    )
    arrived: list[int] = []
    keeper.on_version(arrived.append)
    policy = PolicyAnnouncement(
        step=0,
        manifest_sha256=manifests[0].digest,
        sources=[f"http://127.0.0.1:{port}"],
        published_at=time.time(),
        run=RUN_PARAMETERS,
    )

    async def announced() -> AsyncIterator[PolicyAnnouncement]:
        yield policy
        await asyncio.Event().wait()  # the swarm announces nothing newer

    tasks = [
        asyncio.create_task(keeper.follow(announced()), name="test-validator-policy"),
        asyncio.create_task(keeper.fetch_newest(), name="test-validator-checkpoint-fetch"),
    ]
    try:

        async def refused_once() -> bool:
            return keeper.pinned.retry_in(0) > 0

        await wait_until(refused_once, timeout=10.0, interval=0.02)  # nothing listens on the port yet
        assert keeper.held() == [] and arrived == []
        async with serving(tmp_path / "origin", key.node_id, port=port):

            async def held() -> bool:
                return keeper.held() == [0]

            await wait_until(held, timeout=15.0, interval=0.05)
        assert arrived == [0]  # held files of step 0 are released
        assert keeper.latest_policy == 0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_peer_caught_sending_wrong_bytes_is_never_a_source_again(tmp_path: Path) -> None:
    # Advertised peers come and go with the heartbeats; one that sent a shard not matching the signed manifest
    # is remembered by node id, so it costs at most one shard once, not one per fetch.
    manifests = publish_steps(tmp_path, operator(), [3, 4])
    store_dir = tmp_path / "origin"
    peer = Identity.from_seed(b"\x33" * 32)
    record = sign_availability(peer, manifests[3], frozenset(range(len(manifests[3].body.shards))))
    settings = FAST.model_copy(update={"availability_interval_s": 0.05})
    async with (
        hostile(store_dir, 3, "flip", availability=record) as flipper,
        hostile(store_dir, 3, chunk_delay_s=0.01) as slow_origin,
        serving(store_dir) as origin,
    ):
        pinned = PinnedFetch(
            Store(tmp_path / "node"),
            operator().node_id,
            settings,
            peer_sources=lambda _step: {flipper.url: frozenset({peer.node_id})},
        )
        first = await pinned.fetch(Pin(3, manifests[3].digest, (slow_origin.url,)))
        assert sum(flipper.requests.values()) == 1 and peer.node_id in pinned.dropped_peers
        second = await pinned.fetch(Pin(4, manifests[4].digest, (origin.url,)))
    assert same_tree(first.checkpoint_dir, store_dir / "step-000000000003" / "checkpoint")
    assert same_tree(second.checkpoint_dir, store_dir / "step-000000000004" / "checkpoint")
    assert [s["url"] for s in second.sources] == [origin.url]  # the dropped peer was not even asked
