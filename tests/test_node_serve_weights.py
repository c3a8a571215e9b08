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
    canonical_url,
    server_of,
)
from prime_node.node.contributor.settings import StartSettings
from prime_node.node.contributor.state import NodeState
from prime_node.node.contributor.status import DaemonNotRunning, NodeStatus, fetch_status
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import Hardware, Heartbeat, PolicyAnnouncement, Swarm
from prime_node.p2p.weights.fetch import FetchSettings
from prime_node.p2p.weights.store import Store
from prime_node.trainer.devnet.processes import ProcessGroup

from support.node_daemon import NODE_ENV, NODE_RUN, RUN_ID, node_argv, operator_fleet
from support.swarm import RUN_PARAMETERS, config, wait_until
from support.weights import hostile, publish_steps, same_tree, serving
from support.weights import operator as weights_operator


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
            assert sharing.sources_for(0) == {url: frozenset({status.node_id})}
            assert sharing.sources_for(1) == {}
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


def beat(ident: Identity, url: str, ip: str, client: bool = False, steps: tuple = (3,)) -> Heartbeat:
    """A heartbeat of `ident` naming `url` as its weights server, with `ip` as its one libp2p address."""
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


def test_peer_sources_are_public_addresses_of_the_peer_itself_unless_configured(tmp_path: Path) -> None:
    operator_id, me = Identity.generate(), Identity.generate()
    swarm = Swarm(config(RUN_ID, operator_id), me)  # not joined: only its node id is used here

    def sharing_with(networks: list[str]) -> WeightsSharing:
        settings = StartSettings(
            operator_key=operator_id.node_id, data_dir=tmp_path, peer_weights_networks=networks
        )
        return WeightsSharing(
            Store(tmp_path), settings, operator_id.node_id, swarm, NodeState(me.node_id, operator_id.node_id)
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
        "http://1.2.3.4:8470": frozenset({ids["good"].node_id}),
        "http://1.2.3.4:8471": frozenset({ids["sybil"].node_id}),
    }
    assert sharing.sources_for(4) == {"http://1.2.3.8:8470": frozenset({ids["other"].node_id})}
    assert sharing.sources_for(5) == {}
    refused = {name: sharing.refused.get(ids[name].node_id, "") for name in beats}
    assert "not one of the peer's own addresses" in refused["liar"]
    for name in ("loop", "lan", "link"):
        assert "not a public address" in refused[name], refused
    assert "a name, not an IP address" in refused["named"]
    assert not refused["good"] and not refused["sybil"]

    # A peer naming another's very server (its own id ground to sort first, the other's address listed as its
    # own; spelled with a trailing slash or an explicit port, it is the same URL) no longer switches it off: it
    # is one source with both ids as claimants, and the fetch binds it to the one whose records it serves
    # (tests/test_weights_claims.py). A path makes another URL: a source of the thief's own.
    for stolen in ("http://1.2.3.8:8470/", "http://1.2.3.8:8470", "http://1.2.3.8:8470/v1"):
        thief = Identity.generate()
        with_thief = {**peers, thief.node_id: beat(thief, stolen, "1.2.3.8")}
        sharing = sharing_with([])
        sharing.note_peers(with_thief, banned={ids["banned"].node_id})
        assert thief.node_id not in sharing.refused and ids["other"].node_id not in sharing.refused
        both = frozenset({thief.node_id, ids["other"].node_id})
        if stolen.endswith("/v1"):
            assert sharing.sources_for(4) == {"http://1.2.3.8:8470": frozenset({ids["other"].node_id})}
            assert sharing.sources_for(3)["http://1.2.3.8:8470/v1"] == frozenset({thief.node_id})
            assert sharing.contested == {}
        else:  # the thief says it serves step 3 there as well: a claimant says so, so it is a source for 3 too
            assert sharing.sources_for(4) == {"http://1.2.3.8:8470": both}
            assert sharing.sources_for(3)["http://1.2.3.8:8470"] == both
            assert sharing.contested == {"http://1.2.3.8:8470": both}
    assert server_of("http://[::1]/") == server_of("http://[0:0::1]:80") == "[::1]:80"
    assert canonical_url("http://[0:0::1]/w/") == canonical_url("http://[::1]:80/w") == "http://[::1]:80/w"

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
        assert all(frozenset({crowd[url].node_id}) == claimants for url, claimants in drawn.items())

    # A peer naming many ports on an honest node's host (its address listed as its own) dilutes that host's
    # draw only until this node has found the honest server serving as its node: from then on that server is
    # drawn first. A record of a node that no longer names the URL (it moved) makes it no better than the rest.
    good_url, fakes = "http://1.2.3.4:8470", [f"http://1.2.3.4:{9000 + n}" for n in range(20)]
    diluted = {ids["good"].node_id: beat(ids["good"], good_url, "1.2.3.4")} | {
        (fake := Identity.generate()).node_id: beat(fake, url, "1.2.3.4") for url in fakes
    }
    sharing = sharing_with([])
    sharing.note_peers(diluted, banned=set())
    sharing.note_proven(good_url, ids["other"].node_id)  # another node served there once: not this claimant
    assert not all(good_url in sharing.sources_for(3) for _ in range(40))
    sharing.note_proven(good_url, ids["good"].node_id)
    for _ in range(40):
        drawn = sharing.sources_for(3)
        assert good_url in drawn and len(drawn) == MAX_URLS_PER_HOST
    # Proven servers take all slots of their host but one: a newcomer behind the same address is still drawn.
    for url in fakes[:3]:
        sharing.note_proven(url, next(n for n, b in diluted.items() if b.weights_url == url))
    draws = [sharing.sources_for(3) for _ in range(40)]
    assert all(len(set(d) & {good_url, *fakes[:3]}) >= MAX_URLS_PER_HOST - 1 for d in draws)
    assert any(set(d) - {good_url, *fakes[:3]} for d in draws)

    # An operator whose peers share a private network (or one machine) lists it.
    sharing = sharing_with(["127.0.0.0/8", "10.0.0.0/8"])
    sharing.note_peers(peers, banned={ids["banned"].node_id})
    assert {"http://127.0.0.1:8470", "http://10.0.0.7:8470"} <= set(sharing._peer_urls[3])
    assert "http://169.254.169.254:80" not in sharing._peer_urls[3]
    with pytest.raises(ValueError, match="not an IP network"):
        sharing_with(["10.0.0.0/33"])


async def test_a_server_a_liar_also_names_is_fetched_from_as_the_honest_node_and_the_claim_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A node that moved (its old heartbeat still names the address) or a liar (listing the honest node's address
    # as its own) names the honest node's server. The node still fetches from that server, as the honest node
    # whose records it serves, and counts and logs the other claim with both ids; nobody is charged or banned.
    key = weights_operator()
    manifest = publish_steps(tmp_path, key, [3])[3]
    honest_id, liar_id, me = Identity.generate(), Identity.generate(), Identity.generate()
    settings = StartSettings(
        operator_key=key.node_id, data_dir=tmp_path / "node", peer_weights_networks=["127.0.0.0/8"]
    )
    state = NodeState(me.node_id, key.node_id)
    sharing = WeightsSharing(
        Store(tmp_path / "node"), settings, key.node_id, Swarm(config(RUN_ID, key), me), state
    )
    async with (
        serving(tmp_path / "origin", key.node_id, identity=honest_id) as honest,
        hostile(tmp_path / "origin", 3, chunk_delay_s=0.02) as slow_origin,
    ):
        url = honest.url  # type: ignore[attr-defined]
        sharing.note_peers(
            {
                honest_id.node_id: beat(honest_id, url, "127.0.0.1"),
                liar_id.node_id: beat(liar_id, url + "/", "127.0.0.1"),
            },
            banned=set(),
        )
        claimants = frozenset({honest_id.node_id, liar_id.node_id})
        assert sharing.sources_for(3) == {url: claimants} and sharing.refused == {}
        keeper = CheckpointKeeper(
            Store(tmp_path / "node"),
            key.node_id,
            state,
            async_level=2,
            fetch_settings=FetchSettings(availability_interval_s=0.05, durable=False),
            peer_sources=sharing.sources_for,
            on_proven=sharing.note_proven,
        )
        keeper.announce(
            PolicyAnnouncement(
                step=3,
                manifest_sha256=manifest.digest,
                sources=[slow_origin.url],
                published_at=time.time(),
                run=RUN_PARAMETERS,
            )
        )
        assert await keeper.try_fetch(keeper.announced), state.last_error
        # The contested server sent shards: the slow origin was not asked for every one.
        assert sum(slow_origin.requests.values()) < len(manifest.body.shards), slow_origin.requests
    assert same_tree(keeper.store.checkpoint_dir(3), tmp_path / "origin" / "step-000000000003" / "checkpoint")
    assert keeper.pinned.disproved == {(url, liar_id.node_id): honest_id.node_id}
    assert keeper.pinned.dropped_peers == {}
    assert sharing._proven == {url: honest_id.node_id}  # drawn first on its host from now on
    registry = state.metrics.registry
    assert registry.get_sample_value("prime_node_contributor_weights_claims_disproved_total") == 1
    warning = next(r.getMessage() for r in caplog.records if "signs as peer" in r.getMessage())
    assert liar_id.node_id[:16] in warning and honest_id.node_id[:16] in warning and url in warning
