"""Selective download: bytes and time a pipeline stage's fetch takes against the whole checkpoint's.

Usage: .venv/bin/python benchmarks/selective_fetch.py [--model DIR] [--shard-kib 16] [--repeats 5]

The embedded tiny model (or --model DIR, an HF directory with safetensors) is published as one signed version
cut into --shard-kib shards and served by a real weights server on 127.0.0.1. Each stage of a 2-stage and a
4-stage split is then fetched into an empty store with its selection plan (node/pipeline/weights.py
`StageSelection`: the small files and safetensors headers first, then the stage's tensors), and so is the whole
checkpoint. Bytes are the server's own count of shard bytes sent; times are the median wall-clock of --repeats
fetches (each into a fresh store). Printed per stage: shards, bytes, their ratio to the whole, the time and its
ratio to the whole fetch's time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.node.pipeline.weights import StageSelection
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
from prime_node.p2p.weights.metrics import WeightsServerMetrics
from prime_node.p2p.weights.publish import publish
from prime_node.p2p.weights.server import ServeSettings, WeightsServer
from prime_node.p2p.weights.store import Store

STEP = 1


async def one_fetch(url: str, key: str, out: Path, plan: StageSelection | None) -> tuple[int, float]:
    """(shards held, seconds) of one fetch into the empty store `out`."""
    fetcher = Fetcher([url], key, Store(out), FetchSettings(durable=False))
    began = time.monotonic()
    try:
        result = await fetcher.fetch_version(await fetcher.resolve(STEP), plan)
    finally:
        fetcher.close()
    seconds = time.monotonic() - began
    return (len(result.manifest.body.shards) if result.held is None else len(result.held)), seconds


async def measure(model: Path, shard_kib: int, repeats: int, work: Path) -> None:
    operator = Identity.from_seed(b"\x05" * 32)
    manifest, _ = publish(
        model,
        step=STEP,
        identity=operator,
        out_dir=work / "origin",
        shard_size=shard_kib << 10,
        run_id="bench",
    )
    total, count = manifest.body.total_size, len(manifest.body.shards)
    metrics = WeightsServerMetrics(CollectorRegistry())
    server = WeightsServer(Store(work / "origin"), ServeSettings(port=0, rate_per_s=0), metrics=metrics)
    url = await server.start()
    runs = 0

    async def timed(plan: StageSelection | None) -> tuple[int, int, float]:
        nonlocal runs
        times, held, sent = [], 0, 0
        for _ in range(repeats):
            runs += 1
            before = metrics.sent_bytes._value.get()
            held, seconds = await one_fetch(url, operator.node_id, work / f"node-{runs}", plan)
            sent = int(metrics.sent_bytes._value.get() - before)
            times.append(seconds)
        return held, sent, statistics.median(times)

    try:
        print(f"checkpoint {model}: {total} bytes in {count} shards of {shard_kib} KiB; median of {repeats}")
        _, whole_bytes, whole_s = await timed(None)
        print(
            f"{'whole':>14}: {count:4d} shards {whole_bytes:9d} bytes (1.000)  {whole_s * 1000:7.1f} ms (1.00)"
        )
        for boundaries in ([0, 2, 4], [0, 1, 2, 3, 4]):
            layout = StageLayout(boundaries=boundaries)
            for stage in range(layout.stages):
                plan = StageSelection(layout, frozenset({stage}))
                held, sent, seconds = await timed(plan)
                print(
                    f"{f'{layout.stages} stages, #{stage}':>14}: {held:4d} shards {sent:9d} bytes "
                    f"({sent / whole_bytes:.3f})  {seconds * 1000:7.1f} ms ({seconds / whole_s:.2f})"
                )
    finally:
        await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="HF directory (default: the embedded tiny model)"
    )
    parser.add_argument("--shard-kib", type=int, default=16, help="shard size in KiB (default 16)")
    parser.add_argument("--repeats", type=int, default=5, help="fetches per measurement (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            model = work / "tiny"
            save_model_dir(*build_tiny_model(seed=3), model)
        asyncio.run(measure(model, args.shard_kib, args.repeats, work))


if __name__ == "__main__":
    main()
