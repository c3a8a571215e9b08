"""No weight source can stop a contributor node (issue 18, class 1): hostile sources beside honest ones.

A peer's signed heartbeat may advertise any `weights_url` on its own address, and every node then fetches
from it. Here that URL is tests/support/hostile_http.py in its own process, answering a manifest with
`Content-Length: ²` (what crashed the node before: exit 1) or a body with a lone surrogate, or dripping
shards. The node's checkpoint task must log, back off and retry, fetch the checkpoint from the honest
source, and go on working.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from prime_node.node.contributor.checkpoints import CheckpointKeeper
from prime_node.node.contributor.state import NodeState
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import PolicyAnnouncement
from prime_node.p2p.weights.fetch import FetchSettings
from prime_node.p2p.weights.publish import publish
from prime_node.p2p.weights.sources import SelectionSettings
from prime_node.p2p.weights.store import Store
from prime_node.trainer.devnet.processes import ProcessGroup

from support.node_daemon import (
    NODE_ENV,
    NODE_RUN,
    RUN_ID,
    node_argv,
    node_status,
    operator_fleet,
    policy_steps,
    poll,
)
from support.swarm import RUN_PARAMETERS
from support.weights import hostile_process, operator, publish_steps, same_tree, serving

SHORT = FetchSettings(
    stall_timeout_s=0.5,
    connect_timeout_s=1.0,
    manifest_timeout_s=1.0,
    rate_window_s=1.0,
    hedge_after_s=0.3,
    durable=False,
    max_attempts_per_shard=2,
    selection=SelectionSettings(backoff_base_s=0.02, backoff_max_s=0.2),
)


async def until(check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        await asyncio.sleep(0.05)


def policy(step: int, digest: str, sources: list[str]) -> PolicyAnnouncement:
    return PolicyAnnouncement(
        step=step, manifest_sha256=digest, sources=sources, published_at=time.time(), run=RUN_PARAMETERS
    )


async def test_the_checkpoint_task_survives_hostile_sources_and_gets_the_checkpoint(tmp_path: Path) -> None:
    key = operator()
    manifests = publish_steps(tmp_path, key, [0, 1], megabytes=0.3)
    origin = tmp_path / "origin"
    state = NodeState(node_id=Identity.generate().node_id, operator_key=key.node_id)
    keeper = CheckpointKeeper(
        Store(tmp_path / "node"),
        key.node_id,
        state,
        async_level=2,
        fetch_settings=SHORT,
        retry_s=0.2,
        max_retry_s=0.4,
    )
    with hostile_process(origin) as base:
        crashers = [f"{base}/m-unicode-length", f"{base}/m-surrogate-json"]
        async with serving(origin, key.node_id) as good:
            task = asyncio.create_task(keeper.run(), name="test-checkpoint-fetch")
            try:
                # Hostile sources alone: a refusal (logged, counted, retried later), never an exception.
                keeper.announce(policy(0, manifests[0].digest, crashers))
                await until(lambda: task.done() or state.metrics.verification_failures._value.get() >= 2, 20)
                assert not task.done(), task.exception()
                assert "step 0 refused" in (state.last_error or "") and "ASCII digits" in state.last_error

                # The same hostile sources, and one that drips its shards, beside an honest one: the checkpoint.
                keeper.announce(policy(1, manifests[1].digest, [*crashers, f"{base}/s-drip", good.url]))
                await until(lambda: task.done() or 1 in keeper.verified_steps(), 20)
                assert not task.done(), task.exception()
                assert same_tree(origin / "step-000000000001" / "checkpoint", keeper.store.checkpoint_dir(1))
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


async def test_a_live_node_fed_a_hostile_weights_url_by_a_peer_stays_up_and_moves_on(tmp_path: Path) -> None:
    model, tokenizer = build_tiny_model(seed=0)
    save_model_dir(model, tokenizer, tmp_path / "ckpt")
    operator_id = Identity.generate()
    data_dir = tmp_path / "node"
    Identity.generate().save(data_dir / "node.key")
    run = NODE_RUN.model_copy(update={"samples": 1, "max_new_tokens": 4})
    env = {
        **NODE_ENV,
        "PRIME_NODE_MAX_PENDING_FILES": "1000",  # no validator here: files stay in the outbox
        "PRIME_NODE_PEER_WEIGHTS_NETWORKS": '["127.0.0.0/8"]',  # every peer here is on this machine
    }

    async with operator_fleet(tmp_path / "operator-store", operator_id, run) as (group, operator):
        await operator.announce(0, await operator.publish(tmp_path / "ckpt", 0))
        # Step 1 is made now but kept off the operator's server until the liar has been asked (below); the
        # liar's process serves (its broken version of) step 1's manifest from there.
        staged, _ = await asyncio.to_thread(
            publish,
            tmp_path / "ckpt",
            step=1,
            identity=operator_id,
            out_dir=tmp_path / "staging",
            run_id=RUN_ID,
            shard_size=1 << 20,
        )
        with hostile_process(tmp_path / "staging") as base:
            # A peer whose signed heartbeat says it serves steps 0 and 1 at a URL on its own address.
            liar = await group.add(
                Identity.generate(),
                roles=("contributor", "relay"),
                reachability="public",
                heartbeat_interval_s=0.5,
            )
            liar.weights_url = f"{base}/m-unicode-length"
            liar.serves_steps = [0, 1]
            argv = node_argv(
                data_dir,
                operator_id.node_id,
                (await operator.swarm.maddrs())[:1],
                "--prompts",
                "1",
                "--samples",
                "1",
                "--max-new-tokens",
                "4",
            )
            with ProcessGroup(tmp_path / "logs") as procs:
                node = procs.start("node", argv, env=env)
                await poll(
                    lambda: (s := node_status(data_dir)) and s["local_step"] == 0 and s["peers_seen"] >= 2,
                    150,
                    "step 0 and the hostile peer seen",
                    node,
                )

                # Step 1 is announced before the operator's server has it: until the node has read the liar's
                # heartbeat (with its URL) and asked it, no source can serve the step, so every try waits for
                # every source's answer and the liar's refusal is logged. Racing an honest source that answered
                # first, it was cancelled unasked about half the time.
                # The charge is the liar's alone: its URL and what was wrong with its answer, on one line.
                await operator.announce(1, staged.digest)
                charged = f"source {liar.weights_url}: "
                await poll(
                    lambda: any(
                        charged in line and "is not a number in ASCII digits" in line
                        for line in node.log_tail(2000).splitlines()
                    ),
                    60,
                    "the liar asked and refused",
                    node,
                )
                version = operator.store.version_dir(1).name
                os.replace(tmp_path / "staging" / version, operator.store.root / version)
                await operator.server.rescan()

                # The node moves on: the honest source now serves step 1, and the node generates with it.
                await poll(
                    lambda: (s := node_status(data_dir)) and s["local_step"] == 1, 90, "step 1 fetched", node
                )
                pending = data_dir / "rollouts" / "pending"
                await poll(
                    lambda: any(1 in policy_steps(p) for p in pending.glob("*.parquet")),
                    90,
                    "a rollout of step 1",
                    node,
                )
                assert "Traceback" not in node.log_tail(4000)

                os.kill(node.pid, signal.SIGTERM)
                assert node.process.wait(30) == 0, node.log_tail(40)
