#!/usr/bin/env python
"""Checkpoint broadcast over capped links: time until every node of a swarm holds a verified checkpoint.

Run as root (network namespaces, tests/support/netlab; docs/network.md):

    .venv/bin/python benchmarks/broadcast.py [--sizes 4 8 16 32] [--mbit 50] [--mib 16] [--shard-mib 1]

One lab: an origin (the trainer's weights server), `--relays` relays and max(--sizes) nodes, each a host of
its own whose line is capped at `--mbit` both ways (the origin's uplink too). Each host runs one agent process
(this file with --agent): a real p2p/weights server and Fetcher, driven over a pipe. For each swarm size N and
mode, a new version is published at the origin and N nodes are told to fetch it at once:

  * origin:  every node fetches from the origin alone;
  * relays:  shardcast's model: the relays fetch from the origin and serve each shard once verified, nodes
             fetch from the relays only, no node serves another;
  * reserve: prime-node's verified peer re-serving: every node serves each shard as soon as it verified
             (p2p/weights/serve_verified.py) and signs which it holds (availability.py); each fetches from the
             origin plus MAX_PEER_SOURCES peers drawn at random (what a node takes from the heartbeats of the
             peers that serve the step), rarest first.

Each node reports the monotonic time its version was verified and moved into place; printed per N and mode:
the last and the median node's time, both over the ideal (checkpoint bytes x 8 / link rate: one node alone
on an idle line) and the last over the measured one-node time, and the agents' CPU seconds over the wall
time of the round (near the core count: the machine, not the links, set the pace). Then, from the measured
ratios, when nodes start to miss policy steps for checkpoint sizes and link speeds (--async-level).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

PORT = 8470
MODES = ("origin", "relays", "reserve")


# ----- the agent: one per host, in its namespace ----------------------------------------------------------------


async def agent(args: argparse.Namespace) -> None:
    from prime_node.p2p.identity import Identity
    from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
    from prime_node.p2p.weights.guard import ServeLimits
    from prime_node.p2p.weights.serve_verified import ServeAsVerified
    from prime_node.p2p.weights.server import ServeSettings, WeightsServer
    from prime_node.p2p.weights.store import Store

    store = Store(Path(args.store))
    settings = ServeSettings(
        host=args.ip,
        port=PORT,
        keep=2,
        rate_per_s=0,
        scan_interval_s=0.5,
        limits=ServeLimits(max_connections=4096, max_connections_per_ip=256),
        upload_slots=args.slots,
        super_seed=args.origin and args.super_seed,
    )
    # Nodes and relays sign availability records; the origin, like the trainer's, signs none (it holds all).
    identity = None if args.origin else Identity.from_seed(os.urandom(32))
    server = WeightsServer(store, settings, args.key, identity=identity)
    await server.start()
    fetch_settings = FetchSettings(
        concurrency=args.concurrency,
        min_rate_bytes_s=4096,
        durable=False,
        keep=1,
        stall_timeout_s=30,
        availability_interval_s=args.availability_interval,
    )
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    say({"ready": True, "node_id": identity.node_id if identity is not None else None})
    while line := await reader.readline():
        cmd = json.loads(line)
        if cmd["cmd"] == "rescan":
            await server.rescan()
            say({"id": cmd["id"], "ok": True})
            continue
        hooks = ServeAsVerified(server) if cmd["serve"] else None
        arrivals: list[float] = []  # when each shard verified

        def on_shard(
            index: int, arrivals: list[float] = arrivals, hooks: ServeAsVerified | None = hooks
        ) -> None:
            arrivals.append(time.monotonic())
            if hooks is not None:
                hooks.on_shard(index)

        deadline = time.monotonic() + 60
        while True:  # relays may not hold the manifest yet: asked again, as a node's pinned fetch would
            fetcher = Fetcher(
                cmd["sources"],
                args.key,
                store,
                fetch_settings,
                on_shard=on_shard,
                # URL -> the node ids naming it, as a node takes them from the peers' heartbeats (JSON: one id)
                peers={url: frozenset({node_id}) for url, node_id in (cmd.get("peers") or {}).items()},
            )
            fetcher.on_manifest = hooks.on_manifest if hooks else None
            try:
                resolution = await fetcher.resolve(cmd["step"], digest=cmd["digest"])
                result = await fetcher.fetch_version(resolution)
                break
            except Exception as exc:  # noqa: BLE001 - reported to the controller, which fails the round
                if hooks is not None:
                    hooks.abandoned()
                if time.monotonic() > deadline or "no source served" not in str(exc):
                    say({"id": cmd["id"], "ok": False, "error": str(exc)[:300]})
                    result = None
                    break
                await asyncio.sleep(0.05)
            finally:
                fetcher.close()
        if result is None:
            continue
        done = time.monotonic()
        if hooks is not None:
            hooks.finished(result)
        say(
            {
                "id": cmd["id"],
                "ok": True,
                "done": done,
                "received": result.received_bytes,
                "from_first": sum(s["bytes_ok"] for s in result.sources if s["url"] == cmd["sources"][0]),
                "hedges": result.hedges,
                # When a quarter, half and three quarters of the shards had verified (the pace of the fetch).
                "quarters": [arrivals[int(len(arrivals) * q)] for q in (0.25, 0.5, 0.75)] if arrivals else [],
                "arrivals": arrivals,  # for the swarm's copies over time (one entry per shard)
                **{
                    k: sum(s[k] for s in result.sources)
                    for k in ("lies", "shards_failed", "not_ready", "hints")
                },
            }
        )
    await server.stop()


def say(message: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# ----- the controller -----------------------------------------------------------------------------------------


class Agent:
    """One agent process on a lab host, spoken to over its stdin/stdout."""

    def __init__(
        self,
        host,  # noqa: ANN001
        store: Path,
        key: str,
        concurrency: int,
        slots: int,
        *,
        origin: bool = False,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self.url = f"http://{host.ip}:{PORT}"
        self.node_id: str | None = None  # signs its availability records (said when it is ready)
        argv = [sys.executable, __file__, "--agent", "--ip", host.ip, "--store", str(store), "--key", key]
        argv += ["--concurrency", str(concurrency)] + (["--origin"] if origin else [])
        argv += ["--slots", str(slots), *extra]
        log = open(store.parent / f"{host.name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            host.argv(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1
        )

    def send(self, message: dict[str, object]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"broadcast: agent on {self.host.name} exited ({self.proc.wait()})")
        return json.loads(line)

    def cpu_s(self) -> float:
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def round_of(
    nodes: list[Agent], relays: list[Agent], origin: Agent, mode: str, step: int, digest: str, peers: int
) -> tuple[list[float], float]:
    """One broadcast: seconds until each node held the version, and the agents' CPU seconds meanwhile."""
    everyone = [origin, *relays, *nodes]
    cpu0 = sum(a.cpu_s() for a in everyone)
    began = time.monotonic()
    if mode == "relays":
        for relay in relays:
            relay.send(dict(cmd="fetch", id=step, step=step, digest=digest, sources=[origin.url], serve=True))
    for node in nodes:
        drawn: dict[str, str | None] = {}  # peers: URL -> the node id their heartbeat names
        if mode == "origin":
            sources = [origin.url]
        elif mode == "relays":
            sources = [r.url for r in relays]
        else:
            others = [n for n in nodes if n is not node]
            drawn = {n.url: n.node_id for n in random.sample(others, min(peers, len(others)))}
            sources = [origin.url, *drawn]
        node.send(
            dict(
                cmd="fetch",
                id=step,
                step=step,
                digest=digest,
                sources=sources,
                peers=drawn,
                serve=mode == "reserve",
            )
        )
    times = []
    totals: dict[str, float] = {}
    quarters: list[list[float]] = []
    arrived: list[float] = []  # when each copy of a shard verified at a node, over the round
    for agent in [*nodes, *(relays if mode == "relays" else [])]:
        reply = agent.receive()
        if not reply.get("ok"):
            raise SystemExit(f"broadcast: {agent.host.name} failed in mode {mode}: {reply.get('error')}")
        if agent in nodes:
            times.append(float(reply["done"]) - began)  # type: ignore[arg-type]
            quarters.append([t - began for t in reply["quarters"]])  # type: ignore[union-attr]
            arrived += [t - began for t in reply["arrivals"]]  # type: ignore[union-attr]
            for key in ("received", "from_first", "hedges", "lies", "shards_failed", "not_ready", "hints"):
                totals[key] = totals.get(key, 0) + float(reply[key])  # type: ignore[arg-type]
            # The most super-seeding hints one node got (outcomes.py `hint_budget`: the shards plus 64 are free).
            totals["most_hints"] = max(totals.get("most_hints", 0), float(reply["hints"]))  # type: ignore[arg-type]
    wall = time.monotonic() - began
    totals["cpu"] = (sum(a.cpu_s() for a in everyone) - cpu0) / wall
    arrived.sort()
    for i, q in enumerate((0.25, 0.5, 0.75)):  # when the swarm as a whole held that share of all its copies
        totals[f"swarm{i + 1}"] = arrived[int(len(arrived) * q)] if arrived else 0.0
    for i, q in enumerate(("q1", "q2", "q3")):
        totals[q] = statistics.median(row[i] for row in quarters) if quarters and quarters[0] else 0.0
    return times, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--origin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ip", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--slots", type=int, default=0, help=argparse.SUPPRESS)  # an agent's upload slots
    parser.add_argument("--profile", help="write a cProfile of the first node's event loop to this file")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32], help="swarm sizes N")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--mbit", type=float, default=50.0, help="every host's line, both ways")
    parser.add_argument("--mib", type=float, default=16.0, help="checkpoint size")
    parser.add_argument("--shard-mib", type=float, default=1.0)
    parser.add_argument("--relays", type=int, default=4)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=2,
        help="shard transfers at once per fetch (fetch.concurrency; 2 suits a capped home line, the default 8 "
        "fast links: docs/network.md)",
    )
    parser.add_argument(
        "--availability-interval",
        type=float,
        default=1.0,
        help="seconds between a node's availability polls of one source (fetch.availability_interval_s)",
    )
    parser.add_argument("--origin-slots", type=int, default=2, help="the origin's upload slots (0: no limit)")
    parser.add_argument(
        "--node-slots",
        type=int,
        default=None,
        help="each node's upload slots (0: no limit; default: a node's, serve.upload_slots); relays have none",
    )
    parser.add_argument(
        "--super-seed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the origin super-seeds (serve.super_seed: each shard sent once before any twice; seeding.py)",
    )
    parser.add_argument("--async-level", type=int, default=2, help="for the missed-steps table")
    args = parser.parse_args()
    if args.agent:
        if args.profile:  # the event loop's thread only: the scheduler, the server, availability
            import cProfile  # noqa: PLC0415

            # Timed by the thread's CPU clock: with 37 processes on 2 cores, wall time is mostly waiting.
            profiler = cProfile.Profile(time.thread_time)
            try:
                profiler.runcall(asyncio.run, agent(args))
            finally:
                profiler.dump_stats(args.profile)
        else:
            asyncio.run(agent(args))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the lab and the agents are removed

    from prime_node.node.contributor.serving import MAX_PEER_SOURCES
    from prime_node.node.contributor.settings import NODE_UPLOAD_SLOTS
    from prime_node.p2p.identity import Identity
    from prime_node.p2p.weights.publish import publish

    from support.netlab import Lab, unavailable_reason  # noqa: PLC0415

    if args.node_slots is None:
        args.node_slots = NODE_UPLOAD_SLOTS
    why = unavailable_reason()
    if why is not None:
        raise SystemExit(f"broadcast: {why}")
    operator = Identity.from_seed(os.urandom(32))
    ideal = args.mib * 2**20 * 8 / (args.mbit * 1e6)
    results: dict[tuple[int, str], tuple[list[float], dict[str, float]]] = {}
    size = args.mib * 2**20
    with tempfile.TemporaryDirectory(prefix="broadcast-") as tmp, Lab(Path(tmp) / "lab") as lab:
        root = Path(tmp)
        source = root / "ckpt"
        source.mkdir()
        shard = int(args.shard_mib * 2**20)
        (source / "config.json").write_text('{"model_type": "qwen2"}')
        (source / "model.safetensors").write_bytes(os.urandom(int(args.mib * 2**20)))
        agents: list[Agent] = []

        def start(name: str, slots: int, *, origin: bool = False) -> Agent:
            host = lab.host(name, mbit=args.mbit)
            (root / name).mkdir()
            agent_ = Agent(
                host,
                root / name / "store",
                operator.node_id,
                args.concurrency,
                slots,
                origin=origin,
                extra=(
                    "--availability-interval",
                    str(args.availability_interval),
                    "--super-seed" if args.super_seed else "--no-super-seed",
                    *(("--profile", args.profile) if args.profile and name == "n0" else ()),
                ),
            )
            agents.append(agent_)
            return agent_

        try:
            origin = start("origin", args.origin_slots, origin=True)
            # Relays as `prime-node weights serve` runs them by default (no upload-slot limit).
            relays = [start(f"relay{i}", 0) for i in range(args.relays)] if "relays" in args.modes else []
            nodes = [start(f"n{i}", args.node_slots) for i in range(max(args.sizes))]
            for agent_ in agents:
                ready = agent_.receive()
                if ready.get("ready") is not True:
                    raise SystemExit(f"broadcast: agent on {agent_.host.name} did not start")
                agent_.node_id = ready.get("node_id")  # type: ignore[assignment]
            print(
                f"lab: origin, {len(relays)} relays, {len(nodes)} nodes; every line {args.mbit:g} Mbit/s both ways; "
                f"checkpoint {args.mib:g} MiB in {args.shard_mib:g} MiB shards; ideal (one node alone) {ideal:.2f} s; "
                f"peers per node (reserve) {MAX_PEER_SOURCES}; origin super-seeds: {args.super_seed}; "
                f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            step = 0
            for n, mode in [(1, "origin"), *((n, m) for n in args.sizes for m in args.modes)]:
                step += 1
                manifest, _ = publish(
                    source,
                    step=step,
                    identity=operator,
                    out_dir=root / "origin" / "store",
                    shard_size=shard,
                    run_id="broadcast",
                )
                origin.send({"cmd": "rescan", "id": 0})
                origin.receive()
                results[(n, mode)] = round_of(
                    nodes[:n], relays, origin, mode, step, manifest.digest, MAX_PEER_SOURCES
                )
                times, t = results[(n, mode)]
                print(
                    f"  N={n:<3} {mode:<8} last {max(times):6.2f} s  median {statistics.median(times):6.2f} s  "
                    f"cpu {t['cpu']:.2f} cores; nodes received {t['received'] / size / n:.2f}x the checkpoint, "
                    f"{t['from_first'] / size:.2f} copies from their first source; hedges {t['hedges']:.0f}, "
                    f"failed {t['shards_failed']:.0f}, 503s {t['not_ready']:.0f} (seed hints {t['hints']:.0f}, at most "
                    f"{t['most_hints']:.0f} to a node), lies {t['lies']:.0f}; "
                    f"median node at 1/4, 1/2, 3/4 of its shards: {t['q1']:.1f}, {t['q2']:.1f}, {t['q3']:.1f} s; "
                    f"the swarm at 1/4, 1/2, 3/4 of all copies: {t['swarm1']:.1f}, {t['swarm2']:.1f}, "
                    f"{t['swarm3']:.1f} s",
                    flush=True,
                )
        finally:
            for agent_ in agents:
                agent_.stop()
        shutil.rmtree(root / "ckpt", ignore_errors=True)
    report(results, ideal, args)


def report(
    results: dict[tuple[int, str], tuple[list[float], dict[str, float]]],
    ideal: float,
    args: argparse.Namespace,
) -> None:
    single = max(results[(1, "origin")][0])
    print(f"\none node alone: {single:.2f} s ({single / ideal:.2f}x the ideal {ideal:.2f} s)\n")
    print(
        "| N | mode | last node s | median node s | last / ideal | median / ideal | last / one node | cpu (cores) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for (n, mode), (times, totals) in results.items():
        if n == 1:
            continue
        last, median = max(times), statistics.median(times)
        print(
            f"| {n} | {mode} | {last:.2f} | {median:.2f} | {last / ideal:.2f} | {median / ideal:.2f} | "
            f"{last / single:.2f} | {totals['cpu']:.2f} |"
        )
    biggest = max(n for n, _ in results)
    print(
        f"\nWhen nodes miss policy steps (async level {args.async_level}): the broadcast takes about "
        f"k x size x 8 / rate, with k measured above at N={biggest} (last node / ideal); a node that needs "
        f"longer than async_level x the step time has no usable policy and misses steps."
    )
    ks = {m: max(results[(biggest, m)][0]) / ideal for m in MODES if (biggest, m) in results}
    print(
        "\n| checkpoint | link Mbit/s | "
        + " | ".join(f"{m}: broadcast s (misses if step < s)" for m in ks)
        + " |"
    )
    print("|---|---:|" + "---:|" * len(ks))
    for label, gib in (("1.5B bf16, 3 GiB", 3), ("7B bf16, 15 GiB", 15), ("32B bf16, 62 GiB", 62)):
        for rate in (50, 100, 1000):
            cells = []
            for k in ks.values():
                seconds = k * gib * 2**30 * 8 / (rate * 1e6)
                cells.append(f"{seconds:,.0f} ({seconds / max(1, args.async_level):,.0f})")
            print(f"| {label} | {rate} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
