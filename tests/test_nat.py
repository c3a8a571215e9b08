"""NAT for real (docs/network.md): contributors behind home routers in network namespaces, the real roles
as separate processes (tests/support/netlab, tests/support/netswarm.py).

The fast test holds the dial-back self-test (p2p/swarm/reachability.py) to a real NAT with bare DHT peers:
a public peer stays a full peer, a NAT'd one becomes a DHT client and says which port to forward, and a
NAT'd peer that claims to be public stays a full peer but is told by the dial-back that its port is not
reached. The slow tests run a trainer and a validator on public hosts and contributors (`prime-node start`)
behind home routers: one NAT'd contributor gets its work accepted and credited without the validator ever
trying to connect to it, two behind the same router both do, and a node that claims reachability it does
not have is not advertised as a weights source while a reachable one is.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from prime_node.p2p.swarm import SwarmConfig
from prime_node.trainer.devnet.processes import Child

from support.netlab import Host, Lab, remove_leftovers
from support.netlab.fixture import require_netlab
from support.netswarm import DHT_PORT, RUN_ID, WEIGHTS_PORT, NetSwarm, peer_argv

UNREACHABLE = "cannot be dialled from the internet"


def ready_line(child: Child, timeout_s: float = 90.0) -> dict[str, Any]:
    """The JSON line a bare peer prints once joined (AssertionError with its log if it exits first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in (
            child.log_path.read_text(errors="replace").splitlines() if child.log_path.exists() else []
        ):
            if line.startswith('{"peer"'):
                return json.loads(line)
        if child.process.poll() is not None and not child.log_path.read_text().count('{"peer"'):
            raise AssertionError(f"{child.name} exited ({child.process.returncode}):\n{child.log_tail(30)}")
        time.sleep(0.2)
    raise AssertionError(f"{child.name} did not join within {timeout_s} s:\n{child.log_tail(30)}")


def test_the_dial_back_tells_natted_peers_from_public_ones(netlab: Lab) -> None:
    boot_host, public = netlab.host("boot"), netlab.host("public")
    home = netlab.home("home")
    natted, liar = netlab.host("natted", behind=home), netlab.host("liar", behind=home)
    listen = [f"/ip4/0.0.0.0/tcp/{DHT_PORT}"]
    boot = ready_line(
        boot_host.start(
            "boot",
            peer_argv(SwarmConfig(run_id=RUN_ID, host_maddrs=listen, reachability="public"), stay=True),
        )
    )
    peers = [m for m in boot["maddrs"] if f"/ip4/{boot_host.ip}/" in m]
    assert peers, boot
    home.watch(boot_host.ip)

    def joined(host: Host, name: str, **settings: Any) -> Child:
        config = SwarmConfig(run_id=RUN_ID, initial_peers=peers, host_maddrs=listen, **settings)
        return host.start(name, peer_argv(config, probe=DHT_PORT))

    children = {
        "public": joined(public, "public"),
        "natted": joined(natted, "natted"),
        # Believes its port is forwarded: announces the router's address and skips the self-test.
        "liar": joined(
            liar, "liar", reachability="public", announce_maddrs=[f"/ip4/{home.ip}/tcp/{DHT_PORT}"]
        ),
    }
    seen = {name: ready_line(child) for name, child in children.items()}
    assert seen["public"]["client_mode"] is False and seen["public"]["dial_back"] is True, seen["public"]
    assert seen["natted"]["client_mode"] is True, seen["natted"]
    log = children["natted"].log_path.read_text()
    assert UNREACHABLE in log and f"forward TCP {DHT_PORT}" in log, log[-2000:]
    assert UNREACHABLE not in children["public"].log_path.read_text()
    # The liar is a full peer by its own word, but the dial-back (what a serving node asks before it
    # advertises weights) reaches nothing behind its router.
    assert seen["liar"]["client_mode"] is False and seen["liar"]["dial_back"] is False, seen["liar"]
    assert home.syns_from(boot_host.ip) >= 2  # the probes really went to the router and found nothing there


# ----- the real roles (slow) ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def operator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, NetSwarm]]:
    """A trainer and a validator on public hosts, shared by the slow tests of this module (starting them
    takes half a minute); each test adds its own routers and contributors."""
    require_netlab()
    remove_leftovers()
    root = tmp_path_factory.mktemp("nat")
    with Lab(root / "lab") as lab:
        swarm = NetSwarm(root)
        swarm.start_operator(lab.host("trainer"), lab.host("validator"))
        yield lab, swarm


def wait_for(what: str, check: Any, children: list[Child], timeout_s: float) -> Any:
    """Poll `check()` until it returns something truthy; fail naming `what` (with the logs of any of
    `children` that exited meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in children:
            if child.process.poll() is not None:
                raise AssertionError(f"{child.name} exited while waiting for {what}:\n{child.log_tail(40)}")
        value = check()
        if value:
            return value
        time.sleep(2.0)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def accepted(swarm: NetSwarm, host: Host, member: Any) -> dict[str, Any] | None:
    status = swarm.status(host, member)
    return status if status and status["rollouts"]["accepted"] >= 1 else None


def _accepted(swarm: NetSwarm, host: Host, member: Any) -> Any:
    return lambda: accepted(swarm, host, member)


def credited(swarm: NetSwarm, host: Host, node_ids: set[str]) -> dict[str, Any] | None:
    rows = {row["node_id"]: row for row in swarm.leaderboard(host)["nodes"]}
    return rows if all(rows.get(n, {}).get("accepted_files", 0) >= 1 for n in node_ids) else None


@pytest.mark.slow
@pytest.mark.timeout(900)  # the module's trainer and validator start within it (half a minute)
def test_a_natted_contributor_joins_as_client_and_its_work_is_accepted(
    operator: tuple[Lab, NetSwarm],
) -> None:
    lab, swarm = operator
    home = lab.home("home-a")
    host = lab.host("contributor-a", behind=home)
    trainer, validator = swarm.trainer_host, swarm.validator_host
    assert trainer is not None and validator is not None
    for public in (trainer, validator):
        home.watch(public.ip)
    member, child = swarm.add_node(host, "node-a")
    try:
        status = wait_for("an accepted file", lambda: accepted(swarm, host, member), [child], 300)
        assert status["local_verified"] and status["local_step"] == 0, status
        log = child.log_path.read_text()
        assert UNREACHABLE in log and f"forward TCP {DHT_PORT}" in log, log[-3000:]
        rows = wait_for(
            "the validator's credit", lambda: credited(swarm, host, {member.node_id}), [child], 60
        )
        assert rows[member.node_id]["score"] > 0, rows
        beats = swarm.heartbeats(validator)
        assert beats[member.node_id]["client_mode"] is True and beats[member.node_id]["addresses"] == []
        # The trainer dialled the router back (the self-test); the validator never tried to connect.
        assert home.syns_from(trainer.ip) >= 1
        assert home.syns_from(validator.ip) == 0
    finally:
        lab.processes.stop(child, grace=20)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_contributors_behind_one_nat_both_get_work_accepted(operator: tuple[Lab, NetSwarm]) -> None:
    lab, swarm = operator
    home = lab.home("home-b")
    hosts = [lab.host(f"contributor-b{i}", behind=home) for i in (1, 2)]
    started = [swarm.add_node(host, f"node-b{i}") for i, host in enumerate(hosts, 1)]
    children = [child for _, child in started]
    try:
        for host, (member, _) in zip(hosts, started):
            wait_for(f"an accepted file of {member.name}", _accepted(swarm, host, member), children, 300)
        ids = {member.node_id for member, _ in started}
        rows = wait_for(
            "the validator's credit of both", lambda: credited(swarm, hosts[0], ids), children, 60
        )
        assert len(ids) == 2 and all(rows[n]["accepted_files"] >= 1 for n in ids), rows
    finally:
        lab.processes.stop_together(children, grace=20)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_claiming_reachability_it_lacks_is_not_advertised_as_a_weights_source(
    operator: tuple[Lab, NetSwarm],
) -> None:
    lab, swarm = operator
    home = lab.home("home-c")
    liar_host, honest_host = lab.host("contributor-c", behind=home), lab.host("server-c")
    assert swarm.validator_host is not None
    # Believes its ports are forwarded: announces the router's address, skips the self-test, serves.
    liar, liar_child = swarm.add_node(
        liar_host,
        "node-liar",
        reachability="public",
        serve_weights=True,
        extra=("--announce-maddrs", f"/ip4/{home.ip}/tcp/{DHT_PORT}"),
    )
    honest, honest_child = swarm.add_node(
        honest_host, "node-serving", reachability="auto", serve_weights=True
    )
    children = [liar_child, honest_child]
    try:

        def both_hold_step_0() -> bool:
            statuses = [swarm.status(liar_host, liar), swarm.status(honest_host, honest)]
            return all(s is not None and s["local_verified"] for s in statuses)

        wait_for("both nodes to hold step 0", both_hold_step_0, children, 300)

        def advertised() -> dict[str, Any] | None:
            beats = swarm.heartbeats(swarm.validator_host)  # type: ignore[arg-type]
            return beats if 0 in beats.get(honest.node_id, {}).get("serves_steps", []) else None

        beats = wait_for("the reachable node to advertise step 0", advertised, children, 120)
        assert beats[honest.node_id]["weights_url"] == f"http://{honest_host.ip}:{WEIGHTS_PORT}", beats
        assert beats[liar.node_id]["client_mode"] is False  # it claims to be reachable ...
        assert beats[liar.node_id]["weights_url"] is None and beats[liar.node_id]["serves_steps"] == []  # ...
        assert swarm.status(liar_host, liar)["serving_weights"] is None  # type: ignore[index]
        log = liar_child.log_path.read_text()
        assert f"not serving weights: a peer could not connect to TCP {WEIGHTS_PORT}" in log, log[-3000:]
    finally:
        lab.processes.stop_together(children, grace=20)
