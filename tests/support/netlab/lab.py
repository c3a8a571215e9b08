"""The internet on one machine: hosts in network namespaces, capped links, home routers that NAT.

    internet (namespace "<prefix>-net": a bridge, 10.77.0.0/16)
      |-- public host  10.77.0.2     eth0 <-veth-> port in the bridge   (cap: tbf on both ends)
      |-- home router  10.77.0.3     wan  <-veth-> port in the bridge   (cap: the household's uplink)
            lan bridge 192.168.1.1/24, MASQUERADE out of wan, nothing forwarded in unless answering
              |-- NAT'd host 192.168.1.2   eth0 <-veth-> port in the lan bridge (cap: its own line)

A public host is reachable by every other host at `host.ip`. A host behind a home router reaches the
internet through it (its connections appear to come from `home.ip`), but nobody on the internet can open a
connection to it: the internet has no route to 192.168.0.0/16, and the router's FORWARD chain drops new
connections coming in from wan. Hosts behind the same router reach each other on their LAN.

A cap of R Mbit/s is a tbf qdisc at rate R on the host's side of its link (uplink) and on the other side
(downlink), so both directions are capped separately, like a symmetric line. Latency, where a test needs
it, is added in user space by a delaying TCP proxy (`Lab.delay`; tc netem is not available on every
kernel). Processes run inside a namespace with `ip netns exec`, each in a session of its own, logged to
`<root>/logs/<name>.log`; `Lab.close` (or leaving the `with` block) stops them and removes every namespace.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prime_node.trainer.devnet.processes import Child, ProcessGroup

from .cleanup import FAMILY, remove_namespaces
from .commands import NetlabError, in_ns, run

INTERNET = ipaddress.ip_network("10.77.0.0/16")
WATCH_CHAIN = "NETLAB_WATCH"  # on home routers: counts inbound SYNs per watched source (Home.watch)
_IPT = ["iptables", "-w", "5"]
_counter = itertools.count(1)
DELAY_SCRIPT = Path(__file__).with_name("delay.py")


@dataclass
class Home:
    """A home router: one address on the internet (`ip`), a LAN behind it that it NATs."""

    name: str
    ns: str
    ip: str  # its WAN address: what the internet sees for every host behind it
    lan: ipaddress.IPv4Network
    hosts: list[Host] = field(default_factory=list)

    @property
    def gateway(self) -> str:
        return str(self.lan.network_address + 1)

    def watch(self, source_ip: str) -> None:
        """From now on, count the TCP connections `source_ip` tries to open to this router or through it
        (SYNs arriving on wan, answered or dropped): `syns_from` reads the count."""
        run(in_ns(self.ns, [*_IPT, "-A", WATCH_CHAIN, "-s", source_ip, "-j", "RETURN"]))

    def syns_from(self, source_ip: str) -> int:
        """TCP connection attempts from `source_ip` since `watch(source_ip)`."""
        listing = run(in_ns(self.ns, [*_IPT, "-L", WATCH_CHAIN, "-v", "-x", "-n"]))
        counts = [int(f[0]) for f in (line.split() for line in listing.splitlines()[2:]) if f[7] == source_ip]
        if not counts:
            raise NetlabError(f"{source_ip} is not watched on {self.name}; call watch({source_ip!r}) first")
        return sum(counts)


@dataclass
class Host:
    """One machine: a namespace with one interface `eth0` at `ip`."""

    lab: Lab
    name: str
    ns: str
    ip: str  # its own address (a LAN address when behind a home router)
    home: Home | None = None  # the router that NATs it, if any
    mbit: float | None = None  # the cap of its line, both directions

    @property
    def public_ip(self) -> str:
        """The address the internet sees its connections come from."""
        return self.home.ip if self.home is not None else self.ip

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run on this host."""
        return in_ns(self.ns, list(argv))

    def run(self, argv: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run `argv` here to completion (bounded by `timeout`); its result, whatever its exit status."""
        return subprocess.run(
            self.argv(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> Child:
        """Start `argv` here in the background (its own session; log `<root>/logs/<name>.log`)."""
        return self.lab.processes.start(name, self.argv(argv), env=env, cwd=cwd)


class Lab:
    """A set of namespaces that model hosts on the internet; a context manager that removes them all.

    `Lab(root)` makes the internet; `host()` and `home()` add machines and routers; `host.start()` runs a
    process on one; `close()` ends the processes (SIGTERM, then SIGKILL) and deletes every namespace.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.prefix = f"{FAMILY}{os.getpid()}x{next(_counter)}"
        self.processes = ProcessGroup(self.root / "logs")
        self.namespaces: list[str] = []
        self.hosts: dict[str, Host] = {}
        self.homes: dict[str, Home] = {}
        self._addresses = (str(a) for a in itertools.islice(INTERNET.hosts(), 1, None))  # .1: the switch
        self._ports = itertools.count(1)
        try:
            self.net = self._namespace("net")
            run(["ip", "-n", self.net, "link", "add", "br0", "type", "bridge"])
            run(["ip", "-n", self.net, "link", "set", "br0", "up"])
        except BaseException:
            self.close()
            raise

    # ----- topology ---------------------------------------------------------------------------------------

    def host(self, name: str, *, mbit: float | None = None, behind: Home | None = None) -> Host:
        """A machine on the internet, or behind the home router `behind`; its line capped at `mbit`."""
        if name in self.hosts or name in self.homes:
            raise NetlabError(f"the lab already has a machine named {name!r}")
        ns = self._namespace(name)
        if behind is None:
            ip, prefix = next(self._addresses), INTERNET.prefixlen
            self._plug(ns, "eth0", self.net, "br0", mbit)
        else:
            ip, prefix = str(behind.lan.network_address + 2 + len(behind.hosts)), behind.lan.prefixlen
            self._plug(ns, "eth0", behind.ns, "lan", mbit)
        run(["ip", "-n", ns, "addr", "add", f"{ip}/{prefix}", "dev", "eth0"])
        run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        if behind is not None:
            run(["ip", "-n", ns, "route", "add", "default", "via", behind.gateway])
        host = Host(self, name, ns, ip, behind, mbit)
        if behind is not None:
            behind.hosts.append(host)
        self.hosts[name] = host
        return host

    def home(self, name: str, *, mbit: float | None = None) -> Home:
        """A home router on the internet that NATs the hosts put behind it; its uplink capped at `mbit`."""
        if name in self.hosts or name in self.homes:
            raise NetlabError(f"the lab already has a machine named {name!r}")
        ns = self._namespace(name)
        ip = next(self._addresses)
        lan = ipaddress.ip_network(f"192.168.{len(self.homes) + 1}.0/24")
        self._plug(ns, "wan", self.net, "br0", mbit)
        run(["ip", "-n", ns, "addr", "add", f"{ip}/{INTERNET.prefixlen}", "dev", "wan"])
        run(["ip", "-n", ns, "link", "set", "wan", "up"])
        run(["ip", "-n", ns, "link", "add", "lan", "type", "bridge"])
        run(["ip", "-n", ns, "addr", "add", f"{lan.network_address + 1}/{lan.prefixlen}", "dev", "lan"])
        run(["ip", "-n", ns, "link", "set", "lan", "up"])
        run(in_ns(ns, ["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"]))
        ipt = _IPT
        # A home router: out through wan with its address; in only what answers a connection from inside.
        run(
            in_ns(
                ns, [*ipt, "-t", "nat", "-A", "POSTROUTING", "-s", str(lan), "-o", "wan", "-j", "MASQUERADE"]
            )
        )
        run(in_ns(ns, [*ipt, "-P", "FORWARD", "DROP"]))
        run(in_ns(ns, [*ipt, "-A", "FORWARD", "-i", "lan", "-j", "ACCEPT"]))
        run(
            in_ns(
                ns,
                [
                    *ipt,
                    "-A",
                    "FORWARD",
                    "-m",
                    "conntrack",
                    "--ctstate",
                    "ESTABLISHED,RELATED",
                    "-j",
                    "ACCEPT",
                ],
            )
        )
        run(in_ns(ns, [*ipt, "-N", WATCH_CHAIN]))
        for chain in ("INPUT", "FORWARD"):  # to the router itself, and through it (were it forwarded)
            run(in_ns(ns, [*ipt, "-I", chain, "-i", "wan", "-p", "tcp", "--syn", "-j", WATCH_CHAIN]))
        home = Home(name, ns, ip, lan)
        self.homes[name] = home
        return home

    def delay(self, host: Host, listen_port: int, to: tuple[str, int], delay_ms: float) -> Child:
        """A TCP proxy on `host` at `listen_port` that forwards to `to` and delays every byte by `delay_ms`
        in each direction (so a connection through it sees 2 x `delay_ms` more round-trip time)."""
        argv = [
            sys.executable,
            str(DELAY_SCRIPT),
            "--listen",
            f"0.0.0.0:{listen_port}",
            "--to",
            f"{to[0]}:{to[1]}",
            "--delay-ms",
            str(delay_ms),
        ]
        return host.start(f"delay-{host.name}-{listen_port}", argv)

    # ----- lifecycle --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process the lab started, then remove every namespace it made (processes left in them
        included). Safe to call twice."""
        try:
            self.processes.stop_together(self.processes.alive(), grace=10.0)
        finally:
            remove_namespaces(self.namespaces)
            self.namespaces = []

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- plumbing ---------------------------------------------------------------------------------------

    def _namespace(self, name: str) -> str:
        ns = f"{self.prefix}-{name}"
        run(["ip", "netns", "add", ns])
        self.namespaces.append(ns)
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        return ns

    def _plug(self, ns: str, dev: str, switch_ns: str, bridge: str, mbit: float | None) -> None:
        """A veth pair from `dev` in `ns` to a new port of `bridge` in `switch_ns`, capped both ways."""
        port = f"p{next(self._ports)}"
        # Made directly in the two namespaces: nothing appears in the root namespace, even for a moment.
        run(
            [
                "ip",
                "link",
                "add",
                "name",
                dev,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                switch_ns,
            ]
        )
        run(["ip", "-n", switch_ns, "link", "set", port, "master", bridge])
        run(["ip", "-n", switch_ns, "link", "set", port, "up"])
        if mbit is not None:
            cap(ns, dev, mbit)  # what the host sends: its uplink
            cap(switch_ns, port, mbit)  # what the switch sends to it: its downlink


def cap(ns: str, dev: str, mbit: float) -> None:
    """Limit what `dev` in `ns` sends to `mbit` Mbit/s (token bucket). The bucket holds at least 64 KiB (one
    GSO packet of a veth) or 2 ms at the rate; up to 50 ms of data may queue before packets drop."""
    if not 0 < mbit <= 100_000:
        raise NetlabError(f"a cap must be between 0 and 100000 Mbit/s, not {mbit}")
    burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.002))
    run(
        in_ns(
            ns,
            [
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{mbit}mbit",
                "burst",
                str(burst),
                "latency",
                "50ms",
            ],
        )
    )
