#!/usr/bin/env python
"""One honest weight source among hostile ones: how much longer does a node's fetch take? (target <= 2x)

Measured in one run, on loopback, each figure a fresh fetch into an empty store through the node's own path
(`Fetcher.resolve(step, digest=...)` pinned to the announced manifest, then `fetch_version`, default
FetchSettings):

  honest only   `prime-node weights serve` (a separate process) alone
  + N <kind>    the same honest server plus N hostile sources of one kind, served by tests/support/hostile_http.py
                (a separate process writing raw HTTP): drip (shard bodies one byte per --interval s),
                wrong-bytes (every shard with a flipped byte, at full speed), bad-headers (every shard answered
                with `Content-Length: ²`), stall (half a shard, then silence)
  + all kinds   N of every kind at once

The hostile sources serve the genuine signed manifest (so they are chosen to serve shards) and misbehave on
every shard. Each scenario is fetched --repeat times, the rounds interleaved (so load from elsewhere on the
machine falls on every scenario alike), after one unmeasured fetch from every source that warms both
servers. Each figure is the median of its scenario's fetches, and the ratio is over the median of the
honest-only ones; `slowest x` is the scenario's slowest fetch over the same median, and `cpu x` the median CPU
time this process spent (all its threads) over the honest-only one: what hostile sources cost in work, which
load from elsewhere on the machine does not move the way it moves wall-clock times.
The checkpoint (config.json + random safetensors, --size-mib, --shard-mib shards) lives in a temporary
directory (on /dev/shm when it has room) deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from prime_node.p2p.identity import Identity
from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
from prime_node.p2p.weights.publish import publish
from prime_node.p2p.weights.store import Store

MIB = 1 << 20
HOSTILE_SERVER = Path(__file__).resolve().parent.parent / "tests" / "support" / "hostile_http.py"
KINDS = {
    "drip": "s-drip",
    "wrong-bytes": "s-wrong-bytes",
    "bad-headers": "s-unicode-length",
    "stall": "s-stall",
}


def make_checkpoint(directory: Path, size: int) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "benchmark": True}))
    header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + np.random.default_rng(0).bytes(size))
    return directory


def start(argv: list[str], ready: str) -> tuple[subprocess.Popen[str], str]:
    """Start a server process; returns it and the last word of its first line (its URL or port)."""
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(ready):
        proc.kill()
        raise RuntimeError(f"{argv[1]} did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[-1]


async def fetch_once(
    urls: list[str], key: str, step: int, digest: str, out: Path
) -> tuple[float, dict[str, object]]:
    shutil.rmtree(out, ignore_errors=True)
    fetcher = Fetcher(urls, key, Store(out), FetchSettings())
    began, cpu = time.perf_counter(), time.process_time()
    try:
        result = await fetcher.fetch_version(await fetcher.resolve(step, digest=digest))
    finally:
        fetcher.close()
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    honest = next(s for s in result.sources if s["url"] == urls[0])
    shutil.rmtree(out)
    return seconds, {
        "hedges": result.hedges,
        "hedges_won": result.hedges_won,
        "honest_shards": honest["shards_ok"],
        "cpu": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=32, help="checkpoint size")
    parser.add_argument("--shard-mib", type=float, default=1.0, help="shard size")
    parser.add_argument("--hostile", type=int, default=4, help="hostile sources of each kind (N)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between dripped bytes")
    parser.add_argument("--repeat", type=int, default=5, help="measured fetches of each scenario")
    args = parser.parse_args()
    logging.getLogger("prime_node").setLevel(logging.ERROR)  # each hostile source's refusal is expected here

    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 4 * args.size_mib * MIB else None
    work = Path(tempfile.mkdtemp(prefix="hostile-fetch-", dir=base))
    procs: list[subprocess.Popen[str]] = []
    try:
        key = Identity.generate()
        manifest, _ = publish(
            make_checkpoint(work / "ckpt", args.size_mib * MIB),
            step=1,
            identity=key,
            out_dir=work / "origin",
            shard_size=int(args.shard_mib * MIB),
            run_id="bench",
        )
        cli = Path(sys.executable).parent / "prime-node"
        honest_proc, honest = start(
            [str(cli), "weights", "serve", str(work / "origin"), "--port", "0", "--rate-limit", "0"],
            "serving",
        )
        hostile_proc, port = start(
            [sys.executable, str(HOSTILE_SERVER), str(work / "origin"), "--interval", str(args.interval)],
            "PORT",
        )
        procs += [honest_proc, hostile_proc]
        bad = {
            kind: [f"http://127.0.0.1:{port}/{mode}~{i}" for i in range(args.hostile)]
            for kind, mode in KINDS.items()
        }
        everyone = [u for urls in bad.values() for u in urls]
        scenarios = [("honest only", [])] + [(f"+ {args.hostile} {kind}", urls) for kind, urls in bad.items()]
        scenarios += [(f"+ {len(everyone)} of all kinds", everyone)]

        def fetch(hostile: list[str]) -> tuple[float, dict[str, object]]:
            return asyncio.run(fetch_once([honest, *hostile], key.node_id, 1, manifest.digest, work / "out"))

        fetch(everyone)  # warm-up, not measured: the hostile server reads the checkpoint on its first request
        print(
            f"checkpoint {args.size_mib} MiB in {len(manifest.body.shards)} shards; {os.cpu_count()} cores, "
            f"load average {os.getloadavg()[0]:.1f}; median of {args.repeat} fetches per line"
        )
        runs: dict[str, list[tuple[float, dict[str, object]]]] = {name: [] for name, _ in scenarios}
        for _ in range(args.repeat):
            for name, hostile in scenarios:
                runs[name].append(fetch(hostile))
        baseline = statistics.median(seconds for seconds, _ in runs["honest only"])
        cpu_baseline = statistics.median(float(info["cpu"]) for _, info in runs["honest only"])  # type: ignore[arg-type]
        print(
            f"{'sources':24s} {'seconds':>8s} {'x honest':>9s} {'slowest x':>10s} {'cpu x':>6s} {'hedged':>7s} "
            f"{'won':>4s} {'honest shards':>14s}"
        )
        worst = slowest = 0.0
        for name, _ in scenarios:
            ordered = sorted(runs[name], key=lambda run: run[0])
            seconds, info = ordered[len(ordered) // 2]  # the median fetch, with its own counts
            cpu = statistics.median(float(i["cpu"]) for _, i in ordered) / cpu_baseline  # type: ignore[arg-type]
            worst = max(worst, seconds / baseline)
            slowest = max(slowest, ordered[-1][0] / baseline)
            print(
                f"{name:24s} {seconds:8.3f} {seconds / baseline:9.2f} {ordered[-1][0] / baseline:10.2f} "
                f"{cpu:6.2f} {info['hedges']:7d} {info['hedges_won']:4d} {info['honest_shards']:14d}"
            )
        print(
            f"worst ratio to honest-only: {worst:.2f}x (target <= 2x); slowest single fetch {slowest:.2f}x "
            "(load from elsewhere on the machine included)"
        )
    finally:
        for proc in procs:
            proc.kill()  # by pid: only the servers this script started
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
