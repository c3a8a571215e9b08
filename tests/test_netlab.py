"""The network-namespace harness itself (tests/support/netlab, docs/network.md): a capped line carries what
its cap says in each direction, a home router NATs (its hosts reach out, nobody reaches in), the delaying
proxy adds its latency, and namespaces that a crashed test left are removed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from support.netlab import FAMILY, Lab, can_connect, remove_leftovers, throughput_mbit
from support.netlab.cleanup import owned_namespaces
from support.netlab.fixture import require_netlab

_RTT = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(b"GET / HTTP/1.0\r\n\r\n"); t = time.monotonic(); s.recv(1)
print(time.monotonic() - t)
"""


def _wait_port(host, ip: str, port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not can_connect(host, ip, port, timeout_s=1.0):
        assert time.monotonic() < deadline, f"nothing listens on {ip}:{port} after {timeout_s} s"
        time.sleep(0.2)


def test_a_capped_line_carries_its_cap_each_way_and_no_more(netlab: Lab) -> None:
    server = netlab.host("server", mbit=200)
    node = netlab.host("node", mbit=50)
    down = throughput_mbit(server, node, mbytes=8, port=5201)  # the node's downlink
    up = throughput_mbit(node, server, mbytes=8, port=5202)  # its uplink
    for what, rate in (("downlink", down), ("uplink", up)):
        assert 40 < rate <= 52, f"{what} of a 50 Mbit/s line carried {rate:.1f} Mbit/s"


def test_a_home_router_lets_its_hosts_out_and_nobody_in(netlab: Lab) -> None:
    public = netlab.host("public")
    home = netlab.home("home")
    inside, neighbour = netlab.host("inside", behind=home), netlab.host("neighbour", behind=home)
    assert inside.public_ip == home.ip != inside.ip
    home.watch(public.ip)
    for host in (public, inside):
        host.start(f"http-{host.name}", [sys.executable, "-m", "http.server", "8000"])
    _wait_port(public, public.ip, 8000)
    _wait_port(neighbour, inside.ip, 8000)  # hosts behind one router see each other on their LAN
    assert can_connect(inside, public.ip, 8000)
    assert not can_connect(public, inside.ip, 8000)  # no route in ...
    assert not can_connect(public, home.ip, 8000)  # ... and nothing forwarded through the router
    assert home.syns_from(public.ip) == 1  # the router saw that attempt (the first had no route at all)
    fetched = inside.run(
        [sys.executable, "-c", f"import urllib.request as u; u.urlopen('http://{public.ip}:8000/')"]
    )
    assert fetched.returncode == 0, fetched.stderr
    log = (netlab.root / "logs" / "http-public.log").read_text()
    assert f"{home.ip} - -" in log and inside.ip not in log, log  # the public host saw the router's address


def test_the_delaying_proxy_adds_its_round_trip(netlab: Lab) -> None:
    server, client = netlab.host("server"), netlab.host("client")
    server.start("http", [sys.executable, "-m", "http.server", "8000"])
    netlab.delay(server, 9000, ("127.0.0.1", 8000), delay_ms=100)
    _wait_port(client, server.ip, 8000)
    _wait_port(client, server.ip, 9000)
    direct = float(client.run([sys.executable, "-c", _RTT, server.ip, "8000"]).stdout)
    delayed = float(client.run([sys.executable, "-c", _RTT, server.ip, "9000"]).stdout)
    assert delayed - direct >= 0.19, (direct, delayed)  # 100 ms each way
    assert delayed < 1.0, delayed


def test_namespaces_of_a_crashed_maker_are_removed_and_others_kept(tmp_path: Path) -> None:
    require_netlab()
    # A maker that dies without cleaning up: a child process makes a lab, starts a process in it, is killed.
    script = (
        "import sys, os, time; sys.path.insert(0, sys.argv[1]);"
        "from pathlib import Path; from support.netlab import Lab;"
        "lab = Lab(Path(sys.argv[2])); h = lab.host('h'); h.start('sleeper', ['sleep', '600']);"
        "print(lab.prefix, flush=True); time.sleep(600)"
    )
    tests = str(Path(__file__).parent)
    maker = subprocess.Popen(
        [sys.executable, "-c", script, tests, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert maker.stdout is not None
        prefix = maker.stdout.readline().strip()
        assert prefix.startswith(FAMILY), prefix
    finally:
        maker.kill()
        maker.wait(10)
    left = owned_namespaces(prefix)
    assert len(left) == 2, left  # the internet and h, with the sleeper still inside h
    with Lab(tmp_path / "mine") as mine:  # a live maker's namespaces are not leftovers
        removed = remove_leftovers()
        assert set(left) <= set(removed), removed
        assert not owned_namespaces(prefix)
        assert set(owned_namespaces(mine.prefix)) == set(mine.namespaces)
    assert not owned_namespaces(mine.prefix)
    assert os.path.exists(tmp_path / "logs" / "sleeper.log")


def test_where_a_lab_cannot_be_made_the_reason_names_what_is_missing(monkeypatch) -> None:  # noqa: ANN001
    from support.netlab import commands

    monkeypatch.setattr(commands.os, "geteuid", lambda: 1000)
    assert "need root" in (commands._probe() or "")
    monkeypatch.setattr(commands.os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        commands.shutil, "which", lambda tool: None if tool == "iptables" else f"/usr/sbin/{tool}"
    )
    assert "missing system packages ['iptables']" in (commands._probe() or "")
