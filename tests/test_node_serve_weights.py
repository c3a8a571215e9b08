"""A reachable `prime-node start --serve-weights` serves its verified checkpoints to peers.

A real node subprocess fetches step 0 from a test operator, serves it, and advertises it in its heartbeat;
then `prime-node weights fetch` downloads and verifies it from that node alone, and a second node (its
CheckpointKeeper, the daemon's own fetch path) gets it from the first node after the operator's server is gone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from prime_node.node.cli.main import main
from prime_node.node.contributor.checkpoints import CheckpointKeeper
from prime_node.node.contributor.serving import (
    MAX_PEER_SOURCES,
    MAX_URLS_PER_HOST,
    WeightsSharing,
    server_of,
)
from prime_node.node.contributor.settings import StartSettings
from prime_node.node.contributor.state import NodeState
from prime_node.node.contributor.status import DaemonNotRunning, NodeStatus, fetch_status
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import PolicyAnnouncement
from prime_node.p2p.weights.fetch import FetchSettings
from prime_node.p2p.weights.store import Store
from prime_node.trainer.devnet.processes import ProcessGroup

from support.node_daemon import NODE_ENV, NODE_RUN, RUN_ID, node_argv, operator_fleet
from support.swarm import RUN_PARAMETERS, wait_until


async def serving_status(data_dir: Path, node, timeout: float) -> NodeStatus:  # noqa: ANN001
    """Poll the node's status API (in this process) until it holds step 0 verified and serves weights."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.process.poll() is not None:
            raise AssertionError(f"the node exited ({node.process.returncode}):\n" + node.log_tail(60))
        try:
            status = await fetch_status(data_dir)
        except DaemonNotRunning:
            status = None
        if status is not None and status.local_step == 0 and status.serving_weights:
            return status
        await asyncio.sleep(0.5)
    raise AssertionError(f"the node did not serve step 0 within {timeout} s:\n" + node.log_tail(60))


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


@pytest.mark.slow
async def test_a_reachable_node_serves_and_advertises_its_verified_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, tokenizer = build_tiny_model(seed=0)
    save_model_dir(model, tokenizer, tmp_path / "ckpt")
    operator_id = Identity.generate()
    data_dir = tmp_path / "node"
    Identity.generate().save(data_dir / "node.key")

    # The node generates 1 sample of at most 4 tokens per prompt: the operator announces that run.
    run = NODE_RUN.model_copy(update={"samples": 1, "max_new_tokens": 4})
    async with operator_fleet(tmp_path / "operator-store", operator_id, run) as (group, operator):
        op_swarm = operator.swarm
        digest = await operator.publish(tmp_path / "ckpt", 0)
        await operator.announce(0, digest)
        argv = node_argv(
            data_dir,
            operator_id.node_id,
            (await op_swarm.maddrs())[:1],
            "--serve-weights",
            "--prompts",
            "1",
            "--samples",
            "1",
            "--max-new-tokens",
            "4",
        )
        with ProcessGroup(tmp_path / "logs") as procs:
            node = procs.start("node", argv, env=NODE_ENV)
            status = await serving_status(data_dir, node, 150)
            url = status.serving_weights
            assert url is not None and url.startswith("http://127.0.0.1:")

            async def advertised() -> bool:
                beat = (await op_swarm.list_peers()).get(status.node_id)
                return beat is not None and beat.serves_steps == [0] and beat.weights_url == url

            await wait_until(advertised, 30)

            # The CLI commands run in this process (on a thread: each runs its own event loop).
            capsys.readouterr()
            assert await asyncio.to_thread(main, ["status", "--data-dir", str(data_dir)]) == 0
            text = capsys.readouterr().out
            assert f"serving:        verified checkpoints at {url}" in text, text
            assert "leaderboard:    validator unreachable" in text, text  # no validator announces an API

            # A plain `weights fetch` from the node alone downloads and verifies step 0.
            fetched = await asyncio.to_thread(
                main,
                [
                    "weights",
                    "fetch",
                    "--source",
                    url,
                    "--trainer-key",
                    operator_id.node_id,
                    "--out",
                    str(tmp_path / "plain"),
                    "--step",
                    "0",
                    "--json",
                ],
            )
            assert fetched == 0, capsys.readouterr()
            plain = Store(tmp_path / "plain").checkpoint_dir(0)
            assert same_files(plain, operator.store.checkpoint_dir(0))

            # The operator's server goes away: a second node finds the first one in the heartbeats and
            # fetches the announced step from it, verified against the operator's manifest.
            await operator.server.stop()
            second = await group.add(Identity.generate())
            state = NodeState(second.node_id, operator_id.node_id)
            settings = StartSettings(
                operator_key=operator_id.node_id,
                data_dir=tmp_path / "second",
                peer_weights_networks=["127.0.0.0/8"],  # every peer of this test is on this machine
            )
            sharing = WeightsSharing(Store(tmp_path / "second"), settings, operator_id.node_id, second, state)
            sharing.note_peers(await second.list_peers(), set())
            # With the node id that must sign its availability records: the fetch below uses the first node
            # only on a current record of its own key.
            assert sharing.sources_for(0) == {url: status.node_id} and sharing.sources_for(1) == {}
            keeper = CheckpointKeeper(
                Store(tmp_path / "second"),
                operator_id.node_id,
                state,
                async_level=2,
                fetch_settings=FetchSettings(max_attempts_per_shard=2, durable=False),
                retry_s=60.0,
                max_retry_s=120.0,
                peer_sources=sharing.sources_for,
            )
            keeper.announce(
                PolicyAnnouncement(
                    step=0,
                    manifest_sha256=digest,
                    sources=[operator.url],
                    published_at=time.time(),
                    run=RUN_PARAMETERS,
                )
            )
            assert await keeper.try_fetch(keeper.announced), state.last_error
            assert same_files(keeper.store.checkpoint_dir(0), operator.store.checkpoint_dir(0))

            os.kill(node.pid, signal.SIGTERM)
            assert node.process.wait(30) == 0, node.log_tail(40)


def test_peer_sources_are_public_addresses_of_the_peer_itself_unless_configured(tmp_path: Path) -> None:
    from prime_node.p2p.swarm import Hardware, Heartbeat, Swarm

    from support.swarm import config

    operator_id, me = Identity.generate(), Identity.generate()
    swarm = Swarm(config(RUN_ID, operator_id), me)  # not joined: only its node id is used here

    def sharing_with(networks: list[str]) -> WeightsSharing:
        settings = StartSettings(
            operator_key=operator_id.node_id, data_dir=tmp_path, peer_weights_networks=networks
        )
        return WeightsSharing(
            Store(tmp_path), settings, operator_id.node_id, swarm, NodeState(me.node_id, operator_id.node_id)
        )

    def beat(ident: Identity, url: str, ip: str, client: bool = False, steps: tuple = (3,)) -> Heartbeat:
        return Heartbeat(
            node_id=ident.node_id,
            peer_id="12D3KooW" + "x" * 44,
            version="t",
            roles=["contributor"],
            hardware=Hardware(),
            addresses=[] if client else [f"/ip4/{ip}/tcp/1"],
            client_mode=client,
            serves_steps=list(steps),
            sent_at=time.time(),
            weights_url=url,
        )

    ids = {name: Identity.generate() for name in ("good", "banned", "hidden", "liar", "other", "loop", "lan")}
    ids.update({"link": Identity.generate(), "named": Identity.generate(), "sybil": Identity.generate()})
    beats = {
        "good": beat(ids["good"], "http://1.2.3.4:8470", "1.2.3.4"),
        "banned": beat(ids["banned"], "http://1.2.3.5:8470", "1.2.3.5"),
        "hidden": beat(ids["hidden"], "http://1.2.3.6:8470", "1.2.3.6", client=True),
        "liar": beat(ids["liar"], "http://5.6.7.8:80", "1.2.3.7"),  # not its own address: someone else's
        "other": beat(ids["other"], "http://1.2.3.8:8470", "1.2.3.8", steps=(4,)),
        "loop": beat(ids["loop"], "http://127.0.0.1:8470", "127.0.0.1"),  # this node's own services
        "lan": beat(ids["lan"], "http://10.0.0.7:8470", "10.0.0.7"),  # a host on its private network
        "link": beat(ids["link"], "http://169.254.169.254:80", "169.254.169.254"),  # a cloud metadata service
        "named": beat(ids["named"], "http://weights.example.org:8470", "1.2.3.9"),
        "sybil": beat(ids["sybil"], "http://1.2.3.4:8471", "1.2.3.4"),  # a second id on the good peer's host
    }
    peers = {ids[name].node_id: b for name, b in beats.items()}
    peers[me.node_id] = beat(me, "http://1.2.3.10:8470", "1.2.3.10")

    sharing = sharing_with([])
    sharing.note_peers(peers, banned={ids["banned"].node_id})
    # A source is a server, (host, port), bound to the id whose heartbeat names it: a second id naming the good
    # peer's host on another port is a source of its own, and the good peer stays one whatever the ids' order.
    assert sharing.sources_for(3) == {
        "http://1.2.3.4:8470": ids["good"].node_id,
        "http://1.2.3.4:8471": ids["sybil"].node_id,
    }
    assert sharing.sources_for(4) == {"http://1.2.3.8:8470": ids["other"].node_id}
    assert sharing.sources_for(5) == {}
    refused = {name: sharing.refused.get(ids[name].node_id, "") for name in beats}
    assert "not one of the peer's own addresses" in refused["liar"]
    for name in ("loop", "lan", "link"):
        assert "not a public address" in refused[name], refused
    assert "a name, not an IP address" in refused["named"]
    assert not refused["good"] and not refused["sybil"]

    # A peer naming another's very server (its own id ground to sort first, the other's address listed as its
    # own; spelled with a path or an explicit default port, it is the same server) would have that node's
    # correctly signed records judged as its own lies: neither is used.
    for stolen in ("http://1.2.3.8:8470/", "http://1.2.3.8:8470/v1"):
        thief = Identity.generate()
        with_thief = {**peers, thief.node_id: beat(thief, stolen, "1.2.3.8")}
        sharing = sharing_with([])
        sharing.note_peers(with_thief, banned={ids["banned"].node_id})
        assert sharing.sources_for(4) == {}
        for node_id in (thief.node_id, ids["other"].node_id):
            assert "2 peers name 1.2.3.8:8470 as their weights server" in sharing.refused[node_id]
    assert server_of("http://[::1]/") == server_of("http://[0:0::1]:80") == "[::1]:80"

    # Hosts are drawn, not servers: one host naming many ports counts once and gives at most
    # MAX_URLS_PER_HOST of them, so it cannot crowd the other hosts out of a fetch.
    crowd = {f"http://1.2.4.{n}:8470": Identity.generate() for n in range(1, MAX_PEER_SOURCES + 2)} | {
        f"http://1.2.3.4:{9000 + n}": Identity.generate() for n in range(20)
    }
    crowded = {i.node_id: beat(i, url, urlsplit(url).hostname or "") for url, i in crowd.items()}
    sharing = sharing_with([])
    sharing.note_peers(crowded, banned=set())
    for _ in range(20):
        drawn = sharing.sources_for(3)
        hosts = Counter(urlsplit(url).hostname for url in drawn)
        assert len(hosts) == MAX_PEER_SOURCES and max(hosts.values()) <= MAX_URLS_PER_HOST
        assert all(crowd[url].node_id == node_id for url, node_id in drawn.items())

    # An operator whose peers share a private network (or one machine) lists it.
    sharing = sharing_with(["127.0.0.0/8", "10.0.0.0/8"])
    sharing.note_peers(peers, banned={ids["banned"].node_id})
    assert {"http://127.0.0.1:8470", "http://10.0.0.7:8470"} <= set(sharing._peer_urls[3])
    assert "http://169.254.169.254:80" not in sharing._peer_urls[3]
    with pytest.raises(ValueError, match="not an IP network"):
        sharing_with(["10.0.0.0/33"])
