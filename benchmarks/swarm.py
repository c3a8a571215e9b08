"""Swarm benchmark: N DHT peers, each its own hivemind DHT process with its own p2pd, on loopback.

Measures, in one run:
  * time from the last peer joining until every peer sees every other peer and the current policy
    (DESIGN.md target: 50 peers within 10 s);
  * memory per peer: PSS of every process involved (host processes, DHT processes, p2pd daemons),
    divided by N, with the parts listed (PSS divides pages shared between processes, such as torch's
    libraries and the pages a forked DHT process still shares with its parent, so it sums to real usage);
  * DHT throughput: signed heartbeats stored per second (each a lookup plus stores on up to 5 replicas, all
    validated) and peer tables read per second, all peers at once.

Peers are grouped into host processes (--per-process, default 10): each host runs that many Swarm objects,
each of which forks its own DHT process, which starts its own p2pd; peers share nothing but the host's
Python interpreter. A node process costs about 300 MiB because hivemind imports torch; sharing it is what
lets 50 peers fit on a small machine. --per-process 1 gives one host per peer (the node daemon's layout).

Usage: .venv/bin/python benchmarks/swarm.py [--peers 50] [--per-process 10] [--load-seconds 5]
Each host is this script run with --worker; the coordinator talks to it over stdin/stdout JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUN_ID = "bench"


def _memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB of one process, from /proc/<pid>/smaps_rollup."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time used so far by `pids` (from /proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of the full line
    return total / os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    from prime_node.p2p.processes import child_pids

    pids, frontier = [pid], [pid]
    while frontier:
        children = [c for p in frontier for c in child_pids(p)]
        pids += children
        frontier = children
    return pids


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


# ----- worker (one host process with several peers) ----------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


async def _worker(args: argparse.Namespace) -> None:
    from prime_node.p2p.identity import Identity
    from prime_node.p2p.swarm import Swarm, SwarmConfig, SwarmError

    operator = Identity.from_seed(bytes.fromhex(args.operator_seed))

    def peer(identity: Identity, bootstrap: list[str]) -> Swarm:
        config = SwarmConfig(
            run_id=RUN_ID,
            operator_keys=[operator.node_id],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=bootstrap,
            reachability="public",
        )
        return Swarm(config, identity)

    swarms: list[Swarm] = []
    bootstrap = list(args.bootstrap)
    slots = asyncio.Semaphore(args.join_concurrency)
    retries = 0

    async def join(identity: Identity) -> None:
        # A bootstrap ping can time out on an overloaded machine: that peer starts again (counted), with a
        # fresh DHT process; the benchmark measures the swarm once it is up, not how fast CPUs fork.
        nonlocal retries
        async with slots:
            for attempt in range(3):
                swarm = peer(identity, bootstrap)
                try:
                    await swarm.join()
                except SwarmError:
                    await swarm.leave()
                    if attempt == 2:
                        raise
                    retries += 1
                    continue
                swarms.append(swarm)
                return

    try:
        if not bootstrap:  # this host runs the first peer (the operator): the others bootstrap from it
            await join(operator)
            bootstrap = (await swarms[0].maddrs())[:1]
        await asyncio.gather(*(join(Identity.generate()) for _ in range(args.count - len(swarms))))
        _emit("joined", maddrs=bootstrap, count=len(swarms), retries=retries)
        await _serve_commands(swarms)
    finally:
        await asyncio.gather(*(s.leave() for s in swarms), return_exceptions=True)


async def _serve_commands(swarms: list[Any]) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = json.loads(line)
        if command["do"] == "policy":
            await swarms[0].publish_policy(1, "ab" * 32, ["http://127.0.0.1:1/"])
            _emit("published")
        elif command["do"] == "converge":
            times = await asyncio.gather(*(_converge(s, command["n"], command["deadline"]) for s in swarms))
            _emit("converged", times=times)
        elif command["do"] == "load":
            counts = await asyncio.gather(*(_load(s, command["seconds"]) for s in swarms))
            _emit("loaded", stores=sum(c[0] for c in counts), reads=sum(c[1] for c in counts))
        elif command["do"] == "quit":
            return


async def _converge(swarm: Any, n: int, deadline: float) -> float | None:
    """When (wall clock) this peer first saw n live peers and the policy; None if not by `deadline`.

    Each lookup returns a whole table and costs the swarm about 0.2 s of CPU at n = 50, so a peer stops
    asking for what it has already seen: 50 peers polling everything twice a second saturate two cores.
    """
    seen_peers = seen_policy = False
    while time.time() < deadline:
        peers, policy = await asyncio.gather(
            _nothing() if seen_peers else swarm.list_peers(),
            _nothing() if seen_policy else swarm.current_policy(),
        )
        seen_peers = seen_peers or len(peers or {}) >= n
        seen_policy = seen_policy or policy is not None
        if seen_peers and seen_policy:
            return time.time()
        await asyncio.sleep(0.5)
    return None


async def _nothing() -> None:
    return None


async def _load(swarm: Any, seconds: float) -> tuple[int, int]:
    stores = reads = 0
    end = time.monotonic() + seconds

    async def storer() -> None:
        # Heartbeats are the swarm's most frequent record: each store is a signed, validated overwrite.
        # One at a time per peer: concurrent publishes of one subkey would supersede each other.
        nonlocal stores
        while time.monotonic() < end:
            stores += bool(await swarm.publish_heartbeat())

    async def reader() -> None:
        nonlocal reads
        while time.monotonic() < end:
            await swarm.list_peers()
            reads += 1

    await asyncio.gather(storer(), reader())
    return stores, reads


# ----- coordinator -------------------------------------------------------------------------------------


class Host:
    """One worker process running `count` peers."""

    def __init__(self, count: int, seed: str, bootstrap: list[str], join_concurrency: int) -> None:
        cmd = [sys.executable, __file__, "--worker", "--count", str(count), "--operator-seed", seed]
        cmd += ["--join-concurrency", str(join_concurrency), "--bootstrap", *bootstrap]
        self.count = count
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            message = json.loads(line)
            if message["event"] == event:
                return message
        raise RuntimeError(f"host process {self.proc.pid} exited before {event!r}")


def _memory_report(hosts: list[Host], n: int) -> None:
    parts: dict[str, list[int]] = {"host": [], "dht": [], "p2pd": [], "other": []}
    for host in hosts:
        for pid in _tree(host.proc.pid):
            name = _comm(pid)
            kind = "host" if pid == host.proc.pid else "p2pd" if name == "p2pd" else "other"
            if kind == "other" and name.startswith("python"):
                kind = "dht"  # the forked DHT processes keep the host's command name
            parts[kind].append(_memory_kib(pid)[1])
    total_mib = sum(sum(v) for v in parts.values()) / 1024
    print(f"memory per peer: {total_mib / n:.0f} MiB PSS ({total_mib / 1024:.2f} GiB for {n} peers):")
    for kind, label in (
        ("host", "host processes (Python + torch, shared by the peers in it)"),
        ("dht", "DHT processes (forked from the host)"),
        ("p2pd", "p2pd daemons"),
        ("other", "other helpers (torch_shm_manager)"),
    ):
        values = parts[kind]
        if values:
            print(
                f"  {label}: {len(values)} x median {statistics.median(values) / 1024:.0f} MiB "
                f"= {sum(values) / 1024 / n:.0f} MiB per peer"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=50)
    parser.add_argument("--per-process", type=int, default=10, help="peers per host process")
    parser.add_argument("--load-seconds", type=float, default=5.0)
    parser.add_argument("--join-concurrency", type=int, default=4, help="peers a host starts at once")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--operator-seed", default="", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.worker:
        asyncio.run(_worker(args))
        return

    n, seed = args.peers, os.urandom(32).hex()
    sizes = [min(args.per_process, n - i) for i in range(0, n, args.per_process)]
    started = time.time()
    hosts = [Host(sizes[0], seed, [], args.join_concurrency)]
    try:
        first = hosts[0].expect("joined")
        bootstrap, last_join, retries = first["maddrs"], first["t"], first["retries"]
        # Hosts join one after another: n interpreters importing torch at once would thrash a small machine.
        for size in sizes[1:]:
            hosts.append(Host(size, seed, bootstrap, args.join_concurrency))
            joined = hosts[-1].expect("joined")
            last_join, retries = joined["t"], retries + joined["retries"]
        print(
            f"peers: {n} (each a DHT process + p2pd) in {len(hosts)} host processes of up to "
            f"{args.per_process}, on {os.cpu_count()} cores"
        )
        print(f"all joined {last_join - started:.1f} s after start ({retries} joins retried after a timeout)")
        hosts[0].send(do="policy")
        hosts[0].expect("published")
        deadline = time.time() + 120
        for h in hosts:
            h.send(do="converge", n=n, deadline=deadline)
        times = [t for h in hosts for t in h.expect("converged")["times"]]
        seen = sorted(t - last_join for t in times if t is not None)
        if len(seen) < n:
            print(f"NOT converged within 120 s on {n - len(seen)} of {n} peers")
        if seen:
            print(
                f"every peer sees all {n} peers and the policy: median {statistics.median(seen):.2f} s, "
                f"last {seen[-1]:.2f} s after the last join (target: within 10 s)"
            )
        _memory_report(hosts, n)

        all_pids = [pid for h in hosts for pid in _tree(h.proc.pid)]
        cpu_before = _cpu_seconds(all_pids)
        for h in hosts:
            h.send(do="load", seconds=args.load_seconds)
        loads = [h.expect("loaded") for h in hosts]
        cpu_used = _cpu_seconds(all_pids) - cpu_before
        stores, reads = sum(x["stores"] for x in loads), sum(x["reads"] for x in loads)
        print(
            f"DHT throughput, all peers at once for {args.load_seconds:.0f} s: "
            f"{stores / args.load_seconds:.0f} signed records stored/s, {reads / args.load_seconds:.0f} "
            f"peer tables (≈{n} records each) read/s"
        )
        per_op = 1000 * cpu_used / max(1, stores + reads)
        print(
            f"CPU used by the swarm meanwhile: {cpu_used:.1f} s ({per_op:.0f} ms per operation); "
            f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
    finally:
        _stop(hosts)


def _stop(hosts: list[Host]) -> None:
    """Ask every host to leave; end by PID whatever has not exited (the host, its DHT processes, p2pd)."""
    from prime_node.p2p.processes import end_pids

    for h in hosts:
        if h.proc.poll() is None:
            try:
                h.send(do="quit")
            except (BrokenPipeError, OSError):
                pass
    for h in hosts:
        try:
            h.proc.wait(timeout=30 + 5 * math.ceil(h.count / 4))
        except subprocess.TimeoutExpired:
            # Still our child, so its PID and its descendants' are not reused yet: end the whole tree.
            end_pids(_tree(h.proc.pid)[::-1], 3.0)
            h.proc.wait()


if __name__ == "__main__":
    main()
