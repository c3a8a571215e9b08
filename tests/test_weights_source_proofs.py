"""Dial-back proofs of who serves at a peer's weights URL (node/contributor/source_proofs.py).

Sybils listing an honest node's IP as their own and naming other ports and paths there used to dilute that host's
share of a fetch's draw until the node had once fetched from the honest server. Now the node asks each unproven
URL of such a host for its signed availability record, a few per window: the honest server proves its node id and
is drawn first, the false URLs are held out of the draw, and however many URLs sybils name the probes to the host
stay within their budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from prime_node.node.contributor.serving import MAX_URLS_PER_HOST, WeightsSharing
from prime_node.node.contributor.settings import StartSettings
from prime_node.node.contributor.source_proofs import (
    MAX_URLS_KEPT,
    ProofSettings,
    ProofTarget,
    SourceProver,
)
from prime_node.node.contributor.state import NodeState
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import Hardware, Heartbeat, Swarm
from prime_node.p2p.weights.access import TokenSource
from prime_node.p2p.weights.store import Store

from support.swarm import config
from support.weights import operator as weights_operator
from support.weights import publish_steps, serving

HOST = "127.0.0.1"
RUN_ID = "proofs"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(ident: Identity, url: str, steps: tuple[int, ...] = (3,)) -> Heartbeat:
    """A heartbeat naming `url` as its weights server, listing 127.0.0.1 (the honest node's host) as its own."""
    return Heartbeat(
        node_id=ident.node_id,
        peer_id="12D3KooW" + "x" * 44,
        version="t",
        roles=["contributor"],
        hardware=Hardware(),
        addresses=[f"/ip4/{HOST}/tcp/1"],
        client_mode=False,
        serves_steps=list(steps),
        sent_at=time.time(),
        weights_url=url,
    )


def closed_ports(count: int) -> list[int]:
    """Ports on 127.0.0.1 that nothing listens on (bound, then released: a connection is refused)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@asynccontextmanager
async def silent_server() -> AsyncIterator[str]:
    """A TCP server that accepts and never answers: a probe to it hangs until its deadline cuts it."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, HOST, 0)
    try:
        yield f"http://{HOST}:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


def sharing_for(tmp_path: Path, key: Identity, clock: FakeClock, settings: ProofSettings) -> WeightsSharing:
    me = Identity.generate()
    start = StartSettings(
        operator_key=key.node_id, data_dir=tmp_path / "node", peer_weights_networks=["127.0.0.0/8"]
    )
    sharing = WeightsSharing(
        Store(tmp_path / "node"),
        start,
        key.node_id,
        Swarm(config(RUN_ID, key), me),
        NodeState(me.node_id, key.node_id),
    )
    sharing.prover = SourceProver(
        sharing.note_proven, me, settings, slots_per_host=MAX_URLS_PER_HOST, clock=clock, rng=random.Random(5)
    )
    return sharing


async def test_the_honest_server_among_many_false_urls_on_its_host_is_proven_and_drawn_first(
    tmp_path: Path,
) -> None:
    key = weights_operator()
    publish_steps(tmp_path, key, [3], megabytes=0.2)
    honest_id, impostor_id = Identity.generate(), Identity.generate()
    clock = FakeClock()
    # Each URL is asked once here: an unanswering one is held as long as a wrongly answering one (its short
    # hold, doubled per probe in a row, has its own test). The deadline is loose enough for a loaded machine.
    settings = ProofSettings(
        per_host=4, per_window=32, timeout_s=2.5, window_s=60, hold_s=600, unanswered_hold_s=600
    )
    sharing = sharing_for(tmp_path, key, clock, settings)
    async with (
        serving(tmp_path / "origin", key.node_id, identity=honest_id) as honest,
        serving(tmp_path / "origin", key.node_id, identity=impostor_id) as other_node,
        silent_server() as silent,
    ):
        good = honest.url  # type: ignore[attr-defined]
        # 20 false URLs on the honest host, each under a sybil id that lists the host as its own: closed ports,
        # paths the honest server answers 404 for, a server that never answers, and another node's real server
        # (it signs, but as none of the URL's claimants).
        fakes = [f"http://{HOST}:{port}" for port in closed_ports(10)]
        fakes += [f"{good}/w{n}" for n in range(8)] + [silent, other_node.url]  # type: ignore[attr-defined]
        peers = {honest_id.node_id: beat(honest_id, good)}
        peers |= {(sybil := Identity.generate()).node_id: beat(sybil, url) for url in fakes}
        sharing.note_peers(peers, banned=set())
        assert len(sharing.sources_for(3)) == MAX_URLS_PER_HOST  # one host, diluted: 3 of 21 URLs drawn
        assert not all(good in sharing.sources_for(3) for _ in range(40))

        windows = math.ceil((len(fakes) + 1) / settings.per_host)
        proven_in = None
        for window in range(windows):  # each window probes per_host URLs never asked before
            began = time.monotonic()
            proved = await sharing.prover.prove(*sharing.proof_targets())
            # The silent server is cut at its deadline; the round never waits longer than one probe's.
            assert time.monotonic() - began < settings.timeout_s + 2.0
            assert sharing.prover.window_probes[HOST] <= settings.per_host
            assert await sharing.prover.prove(*sharing.proof_targets()) == 0  # this window's budget is spent
            if proved:
                proven_in = window
            clock.now += settings.window_s
        assert proven_in is not None and sharing.prover.sent == len(fakes) + 1  # each URL asked once
        assert sharing._proven == {good: honest_id.node_id}
        assert sharing.proof_targets()[2] == {HOST}  # its host is asked first from now on
        # Every false URL failed its probe and is held out: the host gives only its honest server.
        for _ in range(20):
            assert sharing.sources_for(3) == {good: frozenset({honest_id.node_id})}
        # Nothing is left to ask until the held-out URLs' time ends, then they are asked again (once each).
        assert (
            await sharing.prover.prove(*sharing.proof_targets()) == 0
            and sharing.prover.sent == len(fakes) + 1
        )
        clock.now += settings.hold_s
        assert good in sharing.sources_for(3)  # proven: drawn first, held-out or not
        await sharing.prover.prove(*sharing.proof_targets())
        assert sharing.prover.window_probes[HOST] == settings.per_host


async def test_no_answer_holds_a_url_out_briefly_and_longer_each_time_a_wrong_answer_for_long(
    tmp_path: Path,
) -> None:
    # A server that hangs (cut by the deadline) and a closed port gave no answer: an honest server restarting
    # looks the same, so they are held out for unanswered_hold_s, doubled at each such probe in a row up to
    # hold_s. A path the server answers 404 for answered wrongly: held out for hold_s at once.
    key = weights_operator()
    publish_steps(tmp_path, key, [3], megabytes=0.2)
    clock = FakeClock()
    proven: list[tuple[str, str]] = []
    settings = ProofSettings(
        timeout_s=1.5, window_s=1, per_host=64, unanswered_hold_s=60, hold_s=300
    )  # the budgets are not what this test is about
    prover = SourceProver(
        lambda u, n: proven.append((u, n)), settings=settings, slots_per_host=0, clock=clock
    )
    claimant = frozenset({Identity.generate().node_id})
    async with (
        silent_server() as silent,
        serving(tmp_path / "origin", key.node_id, identity=Identity.generate()) as server,
    ):
        closed = f"http://{HOST}:{closed_ports(1)[0]}"
        wrong = f"{server.url}/elsewhere"  # type: ignore[attr-defined]
        targets = [ProofTarget(url, claimant, (3,)) for url in (silent, closed, wrong)]
        holds: dict[str, list[float]] = {t.url: [] for t in targets}
        for _ in range(5):  # bounded: each round asks the URLs no longer held, then waits for the next to end
            began = time.monotonic()
            await prover.prove(targets, set())
            # The hanging server is cut by its deadline: a round never waits much longer than one probe.
            assert time.monotonic() - began < settings.timeout_s + 3.0
            for url in [u for u, when in prover._asked.items() if when == clock.now]:
                holds[url].append(prover._held[url] - clock.now)
            clock.now = min(until for until in prover._held.values() if until > clock.now)
    assert holds[silent] == holds[closed] == [60, 120, 240, 300]  # asked at t = 0, 60, 180, 420
    assert holds[wrong] == [300, 300]  # asked at t = 0, 300
    assert proven == []


def test_probes_stay_within_their_budgets_however_many_urls_sybils_name() -> None:
    # A thousand sybils name ports on one victim address (each listing it as its own), and forty other hosts
    # are contested too: a window sends at most per_host probes to a host and per_window in all, never asks an
    # uncontested host, and never asks one URL twice in a window (one asked without a conclusion, as here, is
    # asked again in a later window).
    clock = FakeClock()
    settings = ProofSettings(per_host=4, per_window=32)
    prover = SourceProver(lambda u, n: None, settings=settings, slots_per_host=MAX_URLS_PER_HOST, clock=clock)
    claimant = frozenset({"b" * 64})
    victim = [ProofTarget(f"http://1.2.3.4:{10000 + n}", claimant, (3,)) for n in range(1000)]
    others = [
        ProofTarget(f"http://5.6.{h}.1:{8000 + n}", claimant, (3,)) for h in range(40) for n in range(5)
    ]
    quiet = [ProofTarget(f"http://9.9.9.9:{8000 + n}", claimant, (3,)) for n in range(MAX_URLS_PER_HOST)]
    for _ in range(5):
        plan = prover.due(victim + others + quiet, set())
        hosts = {t.url.split("//")[1].rsplit(":", 1)[0] for t in plan}
        assert len(plan) == settings.per_window and "9.9.9.9" not in hosts
        assert max(prover.window_probes.values()) <= settings.per_host
        assert prover.due(victim + others + quiet, set()) == []  # spent until the window ends
        assert len({t.url for t in plan}) == len(plan)
        clock.now += settings.window_s
    # Proven URLs are never asked; what a node remembers of the URLs it asked is bounded.
    plan = prover.due(victim[:10], {t.url for t in victim[:10]})
    assert plan == []
    wide = SourceProver(
        lambda u, n: None,
        settings=ProofSettings(per_host=64, per_window=1024),
        slots_per_host=MAX_URLS_PER_HOST,
        clock=clock,
    )
    many = [
        ProofTarget(f"http://1.{h // 250}.{h % 250}.1:{8000 + n}", claimant, (3,))
        for h in range(1300)
        for n in range(4)
    ]
    seen: set[str] = set()
    for _ in range(5):  # 5,120 URLs asked, none twice
        plan = wide.due([t for t in many if t.url not in seen], set())
        assert len(plan) == 1024
        seen |= {t.url for t in plan}
        clock.now += settings.window_s
    assert len(wide._asked) == MAX_URLS_KEPT


def test_the_budget_goes_first_to_hosts_proven_before_then_to_hosts_naming_the_announced_step() -> None:
    # Sybils can make contested hosts of any public addresses and name the announced step there too: with
    # forty such hosts and a budget of two hosts a window, a host where a URL was proven before (which no
    # sybil can fake) is still asked in the first window, and a host naming the announced step before
    # one that does not.
    clock = FakeClock()
    claimant = frozenset({"b" * 64})
    settings = ProofSettings(per_host=4, per_window=8)
    sybils = [
        ProofTarget(f"http://5.6.{h}.1:{8000 + n}", claimant, (4,), urgent=True)
        for h in range(40)
        for n in range(5)
    ]
    known = [ProofTarget(f"http://8.8.8.8:{8000 + n}", claimant, (3,)) for n in range(5)]
    for seed in range(10):
        prover = SourceProver(
            lambda u, n: None,
            settings=settings,
            slots_per_host=MAX_URLS_PER_HOST,
            clock=clock,
            rng=random.Random(seed),
        )
        assert prover.window_probes == {} and len(prover.due(sybils + known, set(), {"8.8.8.8"})) == 8
        assert prover.window_probes["8.8.8.8"] == settings.per_host
        quiet = [ProofTarget(t.url, t.claimants, t.steps) for t in sybils]
        prover = SourceProver(
            lambda u, n: None,
            settings=settings,
            slots_per_host=MAX_URLS_PER_HOST,
            clock=clock,
            rng=random.Random(seed),
        )
        prover.due(quiet + [ProofTarget(t.url, t.claimants, (4,), urgent=True) for t in known], set())
        assert prover.window_probes["8.8.8.8"] == settings.per_host


async def test_the_prover_keeps_no_access_tokens_between_rounds() -> None:
    # A token per host:port asked: kept for the node's life they would grow with every port sybils name.
    clock = FakeClock()
    prover = SourceProver(
        lambda u, n: None, Identity.generate(), ProofSettings(timeout_s=2.0), slots_per_host=0, clock=clock
    )
    targets = [ProofTarget(f"http://{HOST}:{port}", frozenset({"b" * 64}), (3,)) for port in closed_ports(3)]
    assert await prover.prove(targets, set()) == 0 and prover.sent == 3
    assert not [v for v in vars(prover).values() if isinstance(v, TokenSource)]


async def test_the_supervised_task_proves_a_contested_host_as_soon_as_its_peers_are_noted(
    tmp_path: Path,
) -> None:
    key = weights_operator()
    publish_steps(tmp_path, key, [3], megabytes=0.2)
    honest_id = Identity.generate()
    settings = ProofSettings(timeout_s=1.0, interval_s=3600)  # only note_peers can wake it within the test
    sharing = sharing_for(tmp_path, key, FakeClock(), settings)
    async with serving(tmp_path / "origin", key.node_id, identity=honest_id) as honest:
        good = honest.url  # type: ignore[attr-defined]
        peers = {honest_id.node_id: beat(honest_id, good)}
        peers |= {
            (s := Identity.generate()).node_id: beat(s, f"{good}/x{n}") for n in range(MAX_URLS_PER_HOST)
        }
        task = asyncio.create_task(sharing.prove_sources(), name="weights-source-proofs")
        try:
            await asyncio.sleep(0.1)
            assert sharing.prover.sent == 0  # no peers yet
            sharing.note_peers(peers, banned=set())
            for _ in range(100):  # bounded: 10 s
                if sharing._proven:
                    break
                await asyncio.sleep(0.1)
            assert sharing._proven == {good: honest_id.node_id}
            assert sharing.prover.sent == MAX_URLS_PER_HOST + 1
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_sybil_naming_the_honest_url_with_steps_it_does_not_serve_cannot_hold_it_out(
    tmp_path: Path,
) -> None:
    # The attack: a sybil names the honest node's own URL with steps it does not serve (the announced step 4,
    # which the honest node has not fetched yet, and 10**9: a heartbeat bounds no step), and three more URLs
    # on its host (paths the honest server answers 404 for) make the host contested. Were the steps of all
    # claimants merged and the newest asked, the honest server would answer 404, be held out, and be asked
    # the same again after each hold: never drawn. Each claimant is asked its own newest step within the
    # announced one, and a URL is held out only once every claimant's step failed there.
    key = weights_operator()
    publish_steps(tmp_path, key, [3], megabytes=0.2)
    honest_id, sybil_id = Identity.generate(), Identity.generate()
    clock = FakeClock()
    settings = ProofSettings(per_host=4, per_window=32, timeout_s=3.0, window_s=60, hold_s=600)
    sharing = sharing_for(tmp_path, key, clock, settings)
    sharing.state.set_announced(4)
    async with serving(tmp_path / "origin", key.node_id, identity=honest_id) as honest:
        good = honest.url  # type: ignore[attr-defined]
        fakes = [f"{good}/x{n}" for n in range(MAX_URLS_PER_HOST)]
        peers = {
            honest_id.node_id: beat(honest_id, good),
            sybil_id.node_id: beat(sybil_id, good, (3, 4, 10**9)),
            # Two sybils name the first false URL, with steps of their own: both must fail before it is held.
            (two := Identity.generate()).node_id: beat(two, fakes[0], (2,)),
        }
        peers |= {(s := Identity.generate()).node_id: beat(s, url) for url in fakes}
        sharing.note_peers(peers, banned=set())
        held: list[dict[str, bool]] = []
        for _ in range(3):  # bounded: a window each
            await sharing.prover.prove(*sharing.proof_targets())
            held.append({url: sharing.prover.held_out(url) for url in [good, *fakes]})
            clock.now += settings.window_s
        drawn = sum(good in sharing.sources_for(3) for _ in range(50))
        assert drawn == 50, f"the honest URL was drawn {drawn} of 50 times"
        assert sharing._proven == {good: honest_id.node_id}
        # Window 1 asked the honest URL about step 4 (404: one claimant's step failed, nothing concluded) and
        # the doubly named false URL about step 3; window 2 asked them about steps 3 (proven) and 2 (held out).
        assert [h[good] for h in held] == [False] * 3
        assert [h[fakes[0]] for h in held] == [False, True, True]
        assert all(h[url] for h in held for url in fakes[1:])
        assert sharing.prover.sent == 4 + 2 + 0  # 10**9 was never asked: it is beyond the announced step
        assert sharing.sources_for(3) == {good: frozenset({honest_id.node_id, sybil_id.node_id})}


def test_each_claimant_is_asked_its_own_newest_step_within_the_announced_one(tmp_path: Path) -> None:
    sharing = sharing_for(tmp_path, weights_operator(), FakeClock(), ProofSettings())
    url = f"http://{HOST}:8470"
    honest, sybil, ahead = Identity.generate(), Identity.generate(), Identity.generate()
    peers = {
        honest.node_id: beat(honest, url, (7, 8)),
        sybil.node_id: beat(sybil, url, (3, 10, 10**9)),
        ahead.node_id: beat(ahead, url, (12, 13)),  # fetched steps this node has not seen announced yet
    }
    sharing.note_peers(peers, banned=set())
    sharing.state.set_announced(10)
    (target,), proven, favoured = sharing.proof_targets()
    assert target.steps == (10, 8, 13) and target.urgent and proven == set() and favoured == set()
    assert target.claimants == frozenset(peers)
    sharing.state.announced_step = None  # none seen yet: each claimant's newest, newest first
    (target,), _, _ = sharing.proof_targets()
    assert target.steps == (10**9, 13, 8) and not target.urgent
    sharing.note_proven(url, honest.node_id)
    assert sharing.proof_targets()[1:] == ({url}, {HOST})
