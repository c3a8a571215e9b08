"""Swarm benchmark: N DHT peers, each its own hivemind DHT process with its own p2pd, on loopback.

Measures, in one run:
  * a timeline from the script's start: host processes ready, first and last peer joined (with the time
    one join took and the CPU the swarm used meanwhile), policy published, every peer has seen all;
  * time until every peer sees every other peer and the current policy (DESIGN.md target: 50 peers
    within 10 s): once the last peer has joined, every peer starts polling (every 0.5 s, each table until
    seen) and the operator's peer publishes a policy; counted from the last join and from the policy's
    publication, never from a point that hides the joining: the timeline above gives the rest;
  * memory per peer: PSS of every process involved (host processes, DHT processes, p2pd daemons),
    divided by N, with the parts listed (PSS divides pages shared between processes, such as torch's
    libraries and the pages a forked DHT process still shares with its parent, so it sums to real usage);
  * the wall and CPU time of one full peer-table read, with hivemind's default lookup beam (20) and with
    the swarm's (beam_size), alternated so that both meet the same machine load;
  * the CPU an idle swarm uses (heartbeats, hivemind's upkeep);
  * DHT throughput: signed heartbeats stored per second (each a lookup plus stores on up to 5 replicas, all
    validated) and peer tables read per second, all peers at once.

Peers are grouped into host processes (--per-process, default 10): each host runs that many Swarm objects,
each of which forks its own DHT process, which starts its own p2pd; peers share nothing but the host's
Python interpreter. A node process costs about 300 MiB because hivemind imports torch; sharing it is what
lets 50 peers fit on a small machine. --per-process 1 gives one host per peer (the node daemon's layout).

Usage: .venv/bin/python benchmarks/swarm.py [--peers 50] [--per-process 10] [--join-concurrency 4]
       [--hosts-at-once 1] [--beam-size 0] [--read-rounds 3] [--idle-seconds 10] [--load-seconds 5]
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
from typing import Any

import psutil

RUN_ID = "bench"


def _memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB of one process ((0, 0) once it is gone)."""
    try:
        info = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return 0, 0
    return info.rss // 1024, getattr(info, "pss", info.rss) // 1024  # PSS: Linux only


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time used so far by `pids`."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


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
        return psutil.Process(pid).name()
    except psutil.Error:
        return "?"


# ----- worker (one host process with several peers) ----------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


async def _worker(args: argparse.Namespace) -> None:
    from prime_node.node.run.announcement import run_parameters
    from prime_node.node.run.settings import RunSettings
    from prime_node.p2p.identity import Identity
    from prime_node.p2p.swarm import Swarm  # noqa: F401  (imported here so that "ready" includes it)

    operator = Identity.from_seed(bytes.fromhex(args.operator_seed))
    swarms: list[Any] = []
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    _emit("ready")  # imports done (hivemind, and with it torch): the host can start peers
    background: set[asyncio.Task[None]] = set()  # convergence runs while the next commands arrive
    try:
        while line := await reader.readline():
            command = json.loads(line)
            if command["do"] == "join":
                await _join_peers(swarms, operator, args, command["bootstrap"])
            elif command["do"] == "policy":
                run = run_parameters(RunSettings())  # no rollouts here: the default run's parameters will do
                await swarms[0].publish_policy(1, "ab" * 32, ["http://127.0.0.1:1/"], run)
                _emit("published")
            elif command["do"] == "converge":
                # Started before the policy is published, as in a live swarm where nodes keep polling.
                task = asyncio.create_task(_converge_all(swarms, command["n"], command["deadline"]))
                background.add(task)
                task.add_done_callback(background.discard)
            elif command["do"] == "load":
                counts = await asyncio.gather(*(_load(s, command["seconds"]) for s in swarms))
                _emit("loaded", stores=sum(c[0] for c in counts), reads=sum(c[1] for c in counts))
            elif command["do"] == "read":
                # One peer reads the whole peer table `reads` times in a row with the given lookup beam.
                reader_swarm = swarms[-1]
                reader_swarm.config.beam_size = command["beam"]
                seen = [len(await reader_swarm.list_peers()) for _ in range(command["reads"])]
                _emit("read", seen=min(seen))
            elif command["do"] == "quit":
                return
    finally:
        await asyncio.gather(*(s.leave() for s in swarms), return_exceptions=True)


async def _join_peers(
    swarms: list[Any], operator: Any, args: argparse.Namespace, bootstrap: list[str]
) -> None:
    """Start this host's peers, join_concurrency at a time; the first host's first peer is the operator."""
    from prime_node.p2p.identity import Identity
    from prime_node.p2p.swarm import Swarm, SwarmConfig, SwarmError

    slots = asyncio.Semaphore(args.join_concurrency)
    retries, durations = 0, []

    async def join(identity: Identity, initial_peers: list[str]) -> None:
        # A bootstrap ping can time out on an overloaded machine: that peer starts again (counted), with a
        # fresh DHT process; its join time counts from its first attempt.
        nonlocal retries
        async with slots:
            started = time.monotonic()
            for attempt in range(3):
                config = SwarmConfig(
                    run_id=RUN_ID,
                    operator_keys=[operator.node_id],
                    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                    initial_peers=initial_peers,
                    reachability="public",
                    **({"beam_size": args.beam_size} if args.beam_size else {}),
                )
                swarm = Swarm(config, identity)
                try:
                    await swarm.join()
                except SwarmError:
                    await swarm.leave()
                    if attempt == 2:
                        raise
                    retries += 1
                    continue
                swarms.append(swarm)
                durations.append(time.monotonic() - started)
                return

    if not bootstrap:  # this host runs the first peer (the operator): the others bootstrap from it
        await join(operator, [])
        bootstrap = (await swarms[0].maddrs())[:1]
        _emit("bootstrap", maddrs=bootstrap)
    await asyncio.gather(*(join(Identity.generate(), bootstrap) for _ in range(args.count - len(swarms))))
    _emit("joined", count=len(swarms), retries=retries, join_s=durations)


async def _converge_all(swarms: list[Any], n: int, deadline: float) -> None:
    times = await asyncio.gather(*(_converge(s, n, deadline) for s in swarms))
    _emit("converged", times=times)


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

    def __init__(self, count: int, seed: str, join_concurrency: int, beam_size: int) -> None:
        cmd = [sys.executable, __file__, "--worker", "--count", str(count), "--operator-seed", seed]
        cmd += ["--join-concurrency", str(join_concurrency), "--beam-size", str(beam_size)]
        self.count = count
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.events: dict[str, dict[str, Any]] = {}  # the last message of each kind, "ready" included
        self._unclaimed: dict[str, dict[str, Any]] = {}  # read while waiting for another kind

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if event in self._unclaimed:
            return self._unclaimed.pop(event)
        while line := self.proc.stdout.readline():
            message = json.loads(line)
            self.events[message["event"]] = message
            if message["event"] == event:
                return message
            self._unclaimed[message["event"]] = message
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


def _read_cost(host: Host, pids: list[int], n: int, ours: int, rounds: int) -> None:
    """Wall and CPU time of one full peer-table read, hivemind's default beam against ours, alternated so
    that both see the same machine load."""
    beams = (20, ours)
    costs: dict[int, list[tuple[float, float]]] = {beam: [] for beam in beams}
    for _ in range(rounds):
        for beam in beams:
            cpu, wall = _cpu_seconds(pids), time.monotonic()
            host.send(do="read", beam=beam, reads=10)
            seen = host.expect("read")["seen"]
            costs[beam].append(((time.monotonic() - wall) / 10, (_cpu_seconds(pids) - cpu) / 10))
            if seen < n:
                print(f"  a read with beam {beam} saw only {seen} of {n} peers")
    print(
        f"one full peer-table read ({n} entries), beams alternated {rounds} times x 10 reads, "
        f"CPU of every swarm process (idle upkeep included):"
    )
    for beam, pairs in costs.items():
        walls, cpus = sorted(w for w, _ in pairs), sorted(c for _, c in pairs)
        runs = ", ".join(f"{1000 * c:.0f}" for c in cpus)
        print(
            f"  beam {beam:2d}: median {1000 * statistics.median(walls):.0f} ms wall, "
            f"{1000 * statistics.median(cpus):.0f} ms CPU (each run: {runs})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=50)
    parser.add_argument("--per-process", type=int, default=10, help="peers per host process")
    parser.add_argument("--load-seconds", type=float, default=5.0)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--read-rounds", type=int, default=3, help="alternations of the read-cost test")
    parser.add_argument("--join-concurrency", type=int, default=4, help="peers a host starts at once")
    parser.add_argument(
        "--hosts-at-once", type=int, default=1, help="host processes starting their peers at the same time"
    )
    parser.add_argument("--beam-size", type=int, default=0, help="SwarmConfig.beam_size (0: its default)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--operator-seed", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.worker:
        asyncio.run(_worker(args))
        return
    load_at_start = os.getloadavg()[0]
    # Imported before the clock starts: importing hivemind (and torch) takes seconds on a loaded machine.
    from prime_node.p2p.swarm import SwarmConfig

    beam = args.beam_size or SwarmConfig().beam_size

    n, seed = args.peers, os.urandom(32).hex()
    sizes = [min(args.per_process, n - i) for i in range(0, n, args.per_process)]
    started = time.time()
    # Every host process starts at once, so that the others' imports (hivemind, torch: seconds of CPU each)
    # overlap the first host's joins; their peers then join --hosts-at-once hosts at a time.
    hosts = [Host(size, seed, args.join_concurrency, args.beam_size) for size in sizes]
    try:
        hosts[0].expect("ready")
        hosts[0].send(do="join", bootstrap=[])
        bootstrap = hosts[0].expect("bootstrap")
        first_join, maddrs = bootstrap["t"], bootstrap["maddrs"]
        joined: list[dict[str, Any]] = []
        for i in range(0, len(hosts), args.hosts_at_once):
            wave = hosts[i : i + args.hosts_at_once]
            for h in wave[1:] if i == 0 else wave:  # the first host is joining already
                h.send(do="join", bootstrap=maddrs)
            joined += [h.expect("joined") for h in wave]
        last_join = max(j["t"] for j in joined)
        ready = max(h.events["ready"]["t"] for h in hosts)
        join_s = sorted(t for j in joined for t in j["join_s"])
        all_pids = [pid for h in hosts for pid in _tree(h.proc.pid)]
        join_cpu = _cpu_seconds(all_pids)  # every process of the swarm is ours and started after `started`
        print(
            f"peers: {n} (each a DHT process + p2pd) in {len(hosts)} host processes of up to "
            f"{args.per_process}, on {os.cpu_count()} cores; machine load average at start "
            f"{load_at_start:.1f}; "
            f"DHT searches keep a beam of {beam} peers per key"
        )
        print("timeline, seconds after the benchmark started:")
        print(f"  {ready - started:6.1f}  all {len(hosts)} host processes ready (hivemind, torch imported)")
        print(f"  {first_join - started:6.1f}  first peer (the bootstrap) joined")
        print(
            f"  {last_join - started:6.1f}  all {n} peers joined ({args.hosts_at_once} host(s) at a time, "
            f"{args.join_concurrency} joins at a time per host; one join took median "
            f"{statistics.median(join_s):.1f} s, max {join_s[-1]:.1f} s; "
            f"{sum(j['retries'] for j in joined)} retried after a timeout)"
        )
        print(
            f"          CPU used by the swarm's processes until then: {join_cpu:.0f} s of the "
            f"{(last_join - started) * (os.cpu_count() or 1):.0f} s the machine's cores had"
        )
        # Every peer starts polling, then the operator publishes the policy: the policy's store and the
        # peers' reads share the machine, as they would in a live swarm.
        deadline = time.time() + 120
        for h in hosts:
            h.send(do="converge", n=n, deadline=deadline)
        policy_sent = time.time()
        hosts[0].send(do="policy")
        published = hosts[0].expect("published")["t"]
        times = [t for h in hosts for t in h.expect("converged")["times"]]
        seen = sorted(t for t in times if t is not None)
        print(
            f"  {policy_sent - started:6.1f}  every peer polling; policy handed to the DHT "
            f"(its store call returned {published - policy_sent:.1f} s later)"
        )
        if seen:
            print(
                f"  {seen[-1] - started:6.1f}  every peer has seen all {n} peers and the policy "
                f"(median peer {statistics.median(seen) - started:.1f})"
            )
        if len(seen) < n:
            print(f"NOT converged within 120 s on {n - len(seen)} of {n} peers")
        if seen:
            print(
                f"discovery, from the last join: every peer sees all {n} peers and the policy after median "
                f"{statistics.median(seen) - last_join:.2f} s, last {seen[-1] - last_join:.2f} s "
                f"(DESIGN target: within 10 s); from the policy's publication: median "
                f"{statistics.median(seen) - policy_sent:.2f} s, last {seen[-1] - policy_sent:.2f} s"
            )
            print(
                f"from the benchmark's start: {seen[-1] - started:.1f} s, "
                f"of which {last_join - started:.1f} s "
                f"starting the {n} peers' processes and joining them"
            )
        _memory_report(hosts, n)

        all_pids = [pid for h in hosts for pid in _tree(h.proc.pid)]
        cpu_before = _cpu_seconds(all_pids)
        time.sleep(args.idle_seconds)
        idle_cpu = _cpu_seconds(all_pids) - cpu_before
        print(
            f"idle swarm (heartbeats every 15 s, hivemind's own upkeep, nobody reading): "
            f"{idle_cpu / args.idle_seconds:.2f} cores busy over {args.idle_seconds:.0f} s"
        )
        _read_cost(hosts[0], all_pids, n, beam, args.read_rounds)
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
