"""Swarm benchmark: N peers as separate processes on loopback.

Measures, in one run:
  * time from the last peer joining until every peer sees every other peer and the current policy
    (DESIGN.md target: 50 peers within 10 s);
  * memory per peer: RSS and PSS of the peer process, its DHT child and its p2pd daemon (PSS divides
    pages shared between processes, such as torch's libraries, among them, so it sums to real usage);
  * DHT throughput: signed heartbeats stored per second (each a lookup plus stores on up to 5 replicas, all
    validated) and peer tables read per second, all peers at once.

Usage: .venv/bin/python benchmarks/swarm.py [--peers 50] [--load-seconds 5]
Each peer is this script run with --worker; the coordinator talks to it over stdin/stdout JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
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


# ----- worker ------------------------------------------------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


async def _worker(args: argparse.Namespace) -> None:
    from prime_node.p2p.identity import Identity
    from prime_node.p2p.swarm import Swarm, SwarmConfig

    operator = Identity.from_seed(bytes.fromhex(args.operator_seed))
    identity = operator if args.index == 0 else Identity.generate()
    config = SwarmConfig(
        run_id=RUN_ID,
        operator_keys=[operator.node_id],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=args.bootstrap or [],
        reachability="public",
    )
    swarm = Swarm(config, identity)
    await swarm.join()
    _emit("joined", maddrs=await swarm.maddrs(), pid=os.getpid())
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            command = json.loads(line)
            if command["do"] == "policy":
                await swarm.publish_policy(1, "ab" * 32, ["http://127.0.0.1:1/"])
                _emit("published")
            elif command["do"] == "converge":
                await _converge(swarm, command["n"], command["deadline"])
            elif command["do"] == "load":
                await _load(swarm, command["seconds"])
            elif command["do"] == "quit":
                break
    finally:
        await swarm.leave()


async def _converge(swarm: Any, n: int, deadline: float) -> None:
    while time.time() < deadline:
        peers, policy = await asyncio.gather(swarm.list_peers(), swarm.current_policy())
        if len(peers) >= n and policy is not None:
            _emit("converged", peers=len(peers))
            return
        await asyncio.sleep(0.5)
    _emit("converged", peers=-1)


async def _load(swarm: Any, seconds: float) -> None:
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
    _emit("loaded", stores=stores, reads=reads, seconds=seconds)


# ----- coordinator -------------------------------------------------------------------------------------


class Peer:
    def __init__(self, index: int, seed: str, bootstrap: list[str]) -> None:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--index",
            str(index),
            "--operator-seed",
            seed,
            "--bootstrap",
            *bootstrap,
        ]
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
        raise RuntimeError(f"peer {self.proc.pid} exited before {event!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=50)
    parser.add_argument("--load-seconds", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=8, help="peers started at once")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--operator-seed", default="", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.worker:
        asyncio.run(_worker(args))
        return

    seed = os.urandom(32).hex()
    started = time.time()
    peers = [Peer(0, seed, [])]
    try:
        first = peers[0].expect("joined")
        bootstrap, last_join = first["maddrs"][:1], first["t"]
        # Start in batches: 50 interpreters importing torch at once would thrash a small machine.
        while len(peers) < args.peers:
            batch = [
                Peer(i, seed, bootstrap) for i in range(len(peers), min(args.peers, len(peers) + args.batch))
            ]
            last_join = max([last_join, *(p.expect("joined")["t"] for p in batch)])
            peers += batch
        print(f"peers: {args.peers} processes (+ a DHT child and a p2pd each) on {os.cpu_count()} cores")
        print(f"all joined {last_join - started:.1f} s after start (batches of {args.batch})")
        peers[0].send(do="policy")
        peers[0].expect("published")
        deadline = time.time() + 120
        for p in peers:
            p.send(do="converge", n=args.peers, deadline=deadline)
        done = [p.expect("converged") for p in peers]
        if any(d["peers"] < 0 for d in done):
            print("NOT converged within 120 s on some peers")
        converge = max(d["t"] for d in done) - last_join
        print(f"every peer sees all {args.peers} peers and the policy: {converge:.2f} s after the last join")

        per_peer = [[_memory_kib(pid) for pid in _tree(p.proc.pid)] for p in peers]
        rss = [sum(r for r, _ in tree) / 1024 for tree in per_peer]
        pss = [sum(s for _, s in tree) / 1024 for tree in per_peer]
        print(
            f"memory per peer (process + DHT child + p2pd): RSS median {statistics.median(rss):.0f} MiB, "
            f"PSS median {statistics.median(pss):.0f} MiB (total PSS {sum(pss) / 1024:.1f} GiB)"
        )

        all_pids = [pid for p in peers for pid in _tree(p.proc.pid)]
        cpu_before = _cpu_seconds(all_pids)
        for p in peers:
            p.send(do="load", seconds=args.load_seconds)
        loads = [p.expect("loaded") for p in peers]
        cpu_used = _cpu_seconds(all_pids) - cpu_before
        stores = sum(x["stores"] for x in loads)
        reads = sum(x["reads"] for x in loads)
        print(
            f"DHT throughput, all peers at once for {args.load_seconds:.0f} s: "
            f"{stores / args.load_seconds:.0f} signed records stored/s, {reads / args.load_seconds:.0f} "
            f"peer tables (≈{args.peers} records each) read/s"
        )
        per_op = 1000 * cpu_used / max(1, stores + reads)
        print(
            f"CPU used by the swarm meanwhile: {cpu_used:.1f} s ({per_op:.0f} ms per operation); "
            f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
    finally:
        _stop(peers)


def _stop(peers: list[Peer]) -> None:
    """Ask every peer to leave; end by PID whatever has not exited (the peer, its DHT child, its p2pd)."""
    from prime_node.p2p.processes import end_pids

    for p in peers:
        if p.proc.poll() is None:
            try:
                p.send(do="quit")
            except (BrokenPipeError, OSError):
                pass
    for p in peers:
        try:
            p.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # Still our child, so its PID and its descendants' are not reused yet: end the whole tree.
            end_pids(_tree(p.proc.pid)[::-1], 3.0)
            p.proc.wait()


if __name__ == "__main__":
    main()
