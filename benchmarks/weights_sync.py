#!/usr/bin/env python
"""Weight sync on loopback: our verified fetch vs the `shardcast` package, vs this machine's limit, 3 vs 1 source.

Everything is measured in one run and printed as ratios (absolute figures depend on the machine):

  limit       min(raw loopback transfer: one TCP stream, sendfile -> recv_into; SHA-256 of the file on all cores)
  CPU budget  the physical limit of a verified fetch on this machine: the CPU time per GiB of each thing a
              fetch must do, measured apart (SHA-256; recv_into on loopback; pwrite into a file where the
              fetch writes; sendfile on loopback: each thread's own CPU clock), summed, over the cores:
              no fetch that hashes, receives, writes and serves every byte on this machine can go faster
  shardcast   shardcast's own origin (`shardcast.initialize` + `broadcast`) and client (`ClientNode.download_version`,
              which downloads the shards, reassembles them and checks the file's blake3), run from a throwaway venv
  ours x1     `prime-node weights serve` (a separate process) -> Fetcher.fetch(): every shard SHA-256-verified
              on arrival, signature checked, fsync'ed and moved into place
  ours x3     the same with three server processes as sources

The checkpoint is an HF-style directory (config.json + a random safetensors file of --size-gib) in a temporary
directory (on /dev/shm when it has room, so that the disk does not dominate), deleted at the end. shardcast is
installed with pip into --shardcast-venv (default /tmp/shardcast-venv), never into the project's environment;
when it cannot be installed or run the reason is printed and the other figures are still measured.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from prime_node.p2p.identity import Identity
from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
from prime_node.p2p.weights.publish import publish
from prime_node.p2p.weights.store import Store

GIB = 1 << 30
MIB = 1 << 20

SHARDCAST_ORIGIN = r"""
import os, sys, time, shardcast
data_dir, path, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
shardcast.initialize(data_dir=data_dir, port=port)
version = shardcast.broadcast(path)
# shardcast 0.3.x's client probes every server with GET /data1.bin before downloading (ShardDownloader init).
open(os.path.join(data_dir, "data1.bin"), "wb").write(b"x" * 1024)
print(version, flush=True)
sys.stdin.read()  # serve until the benchmark closes our stdin
shardcast.shutdown()
"""

SHARDCAST_CLIENT = r"""
import json, sys, time
from shardcast import ClientNode
servers, out_dir, version = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
client = ClientNode(servers, out_dir)  # probes the servers; not timed
start = time.perf_counter()
path = client.download_version(version, out_dir + "/model.safetensors")
print(json.dumps({"seconds": time.perf_counter() - start, "ok": path is not None}), flush=True)
"""


def make_checkpoint(directory: Path, size: int) -> Path:
    """config.json + one safetensors file of `size` random bytes, written in 64 MiB pieces (bounded memory)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "benchmark": True}))
    piece = 64 * MIB
    count = max(1, size // piece)
    header = {
        f"layer{i}.weight": {"dtype": "U8", "shape": [piece], "data_offsets": [i * piece, (i + 1) * piece]}
        for i in range(count)
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _ in range(count):
            f.write(rng.bytes(piece))
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_loopback(path: Path) -> float:
    """Bytes/s of one TCP stream on 127.0.0.1: sendfile on one side, recv_into a reused buffer on the other."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def send() -> None:
        conn, _ = listener.accept()
        with conn, open(path, "rb") as f:
            conn.sendfile(f)

    sender = threading.Thread(target=send, name="bench-loopback-send")
    sender.start()
    size = path.stat().st_size
    buf = memoryview(bytearray(4 * MIB))
    with socket.create_connection(listener.getsockname()) as client:
        start, got = time.perf_counter(), 0
        while got < size:
            n = client.recv_into(buf)
            if not n:
                break
            got += n
        seconds = time.perf_counter() - start
    sender.join()
    listener.close()
    return got / seconds


def measure_sha256(path: Path) -> float:
    """Bytes/s of SHA-256 over the file's contents (in memory), 16 MiB pieces on one thread per core."""
    data = path.read_bytes()
    view = memoryview(data)
    pieces = [view[i : i + 16 * MIB] for i in range(0, len(data), 16 * MIB)]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        start = time.perf_counter()
        list(pool.map(lambda p: hashlib.sha256(p).digest(), pieces))
        seconds = time.perf_counter() - start
    return len(data) / seconds


def cpu_costs(path: Path, scratch: Path) -> dict[str, float]:
    """CPU seconds per GiB of each part of a verified fetch, each measured alone on its own thread's CPU clock
    (user + system time of that thread): SHA-256, loopback receive, file write, loopback send (sendfile)."""
    data = path.read_bytes()
    size = len(data)
    view = memoryview(data)
    costs: dict[str, float] = {}
    begin = time.thread_time()
    for i in range(0, size, MIB):
        hashlib.sha256(view[i : i + MIB]).digest()  # the fetch hashes per chunk_bytes (1 MiB) as it arrives
    costs["hash"] = time.thread_time() - begin
    target = scratch / "write-cost.bin"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        begin = time.thread_time()
        for i in range(0, size, MIB):
            os.pwrite(fd, view[i : i + MIB], i)
        costs["write"] = time.thread_time() - begin
    finally:
        os.close(fd)
        target.unlink()
    del view, data
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    sent: list[float] = []

    def send() -> None:
        conn, _ = listener.accept()
        with conn, open(path, "rb") as f:
            start = time.thread_time()
            conn.sendfile(f)
            sent.append(time.thread_time() - start)

    sender = threading.Thread(target=send, name="bench-cost-send")
    sender.start()
    buf = memoryview(bytearray(MIB))
    with socket.create_connection(listener.getsockname()) as client:
        begin, got = time.thread_time(), 0
        while got < size:
            n = client.recv_into(buf)  # readinto1 on a buffered socket file, as the fetch reads
            if not n:
                break
            got += n
        costs["receive"] = time.thread_time() - begin
    sender.join()
    listener.close()
    costs["send"] = sent[0]
    return {name: seconds * GIB / size for name, seconds in costs.items()}


def start_our_server(origin: Path) -> tuple[subprocess.Popen[str], str]:
    cli = Path(sys.executable).parent / "prime-node"
    proc = subprocess.Popen(
        [str(cli), "weights", "serve", str(origin), "--port", "0", "--rate-limit", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("serving"):
        proc.kill()
        raise RuntimeError(f"prime-node weights serve did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[-1]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (a server child; its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CPU_SPENT: dict[str, float] = {}  # core-seconds of the cheapest fetch per contender (fetcher + its servers)


def fetch_ours(urls: list[str], key: str, out: Path, servers: list[int], name: str) -> float:
    shutil.rmtree(out, ignore_errors=True)
    fetcher = Fetcher(urls, key, Store(out), FetchSettings())
    cpu0 = time.process_time() + sum(process_cpu_s(pid) for pid in servers)
    start = time.perf_counter()
    asyncio.run(fetcher.fetch())
    seconds = time.perf_counter() - start
    cpu = time.process_time() + sum(process_cpu_s(pid) for pid in servers) - cpu0
    CPU_SPENT[name] = min(CPU_SPENT.get(name, float("inf")), cpu)
    shutil.rmtree(out)
    return seconds


def profile_fetch(url: str, key: str, out: Path, path: Path, total: int) -> None:
    """One 1-source fetch with the event loop's thread under cProfile, timed by that thread's CPU clock: on a
    shared machine wall time would measure the waits for a core, not our work. The transfer threads (hashing,
    receiving, writing: the budget above) are not in it."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    shutil.rmtree(out, ignore_errors=True)
    profiler = cProfile.Profile(time.thread_time)
    cpu0 = time.process_time()
    profiler.enable()
    asyncio.run(Fetcher([url], key, Store(out), FetchSettings()).fetch())
    profiler.disable()
    cpu = time.process_time() - cpu0
    shutil.rmtree(out)
    profiler.dump_stats(path)
    stats = pstats.Stats(profiler)
    loop_s = stats.total_tt  # type: ignore[attr-defined]
    print(
        f"\nprofile ({path}): the event loop's thread used {loop_s * GIB / total:.3f} core-seconds per GiB, "
        f"{loop_s / cpu:.1%} of the fetching process's CPU ({cpu * GIB / total:.2f} per GiB)"
    )
    stats.sort_stats("tottime").print_stats(12)


def wait_or_kill(proc: subprocess.Popen[str], timeout: float) -> None:
    """Give a child `timeout` seconds to exit after being asked to, then end it by its PID."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ensure_shardcast(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, text=True)
    probe = subprocess.run([str(python), "-c", "import shardcast"], capture_output=True, text=True)
    if probe.returncode != 0:
        install = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "shardcast"], capture_output=True, text=True
        )
        if install.returncode != 0:
            raise RuntimeError(f"pip install shardcast failed: {install.stderr.strip()[-400:]}")
    if shutil.which("wget") is None:
        raise RuntimeError("shardcast's client downloads with wget, which is not installed here")
    return python


class Shardcast:
    """shardcast's own origin (a child process of the throwaway venv) and one client run per measurement."""

    def __init__(self, python: Path, ckpt_file: Path, work: Path) -> None:
        self.python, self.ckpt_file = python, ckpt_file
        self.data_dir, self.out_dir, self.port = (
            work / "shardcast-origin",
            work / "shardcast-out",
            free_port(),
        )
        self.env = {**os.environ, "SHARDCAST_LOG_LEVEL": "WARNING"}
        self.origin = subprocess.Popen(
            [str(python), "-c", SHARDCAST_ORIGIN, str(self.data_dir), str(ckpt_file), str(self.port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=self.env,
        )
        assert self.origin.stdout is not None
        self.version = self.origin.stdout.readline().strip()
        if not self.version:
            self.stop()
            raise RuntimeError("shardcast origin exited before broadcasting")

    def fetch_once(self) -> float:
        shutil.rmtree(self.out_dir, ignore_errors=True)
        done = subprocess.run(
            [
                str(self.python),
                "-c",
                SHARDCAST_CLIENT,
                f"http://127.0.0.1:{self.port}",
                str(self.out_dir),
                self.version,
            ],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=600,
        )
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"shardcast client failed: {done.stderr.strip()[-400:]}")
        result = json.loads(lines[-1])
        if not result["ok"]:
            raise RuntimeError("shardcast client reported a failed download or checksum")
        if (self.out_dir / "model.safetensors").stat().st_size != self.ckpt_file.stat().st_size:
            raise RuntimeError("shardcast client wrote a file of the wrong size")
        shutil.rmtree(self.out_dir, ignore_errors=True)
        return float(result["seconds"])

    def stop(self) -> None:
        self.origin.stdin.close()  # type: ignore[union-attr]
        wait_or_kill(self.origin, 10)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size (default 1 GiB)")
    parser.add_argument(
        "--shard-size", type=int, default=16 * MIB, help="our shard size (shardcast keeps its default)"
    )
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best is kept")
    parser.add_argument("--tmp", type=Path, default=None, help="where the temporary files go")
    parser.add_argument("--shardcast-venv", type=Path, default=Path("/tmp/shardcast-venv"))
    parser.add_argument("--skip-shardcast", action="store_true")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="after the measurements, one more 1-source fetch under cProfile (the event loop's own CPU time: "
        "the scheduler, the journal, the callbacks), saved to this file; its top functions are printed",
    )
    args = parser.parse_args()
    size = int(args.size_gib * GIB)
    base = args.tmp or (
        Path("/dev/shm") if shutil.disk_usage("/dev/shm").free > 4 * size else Path(tempfile.gettempdir())
    )
    work = Path(tempfile.mkdtemp(prefix="weights-bench-", dir=base))
    servers: list[subprocess.Popen[str]] = []
    shardcast: Shardcast | None = None
    try:
        ckpt = make_checkpoint(work / "ckpt", size)
        model = ckpt / "model.safetensors"
        total = sum(p.stat().st_size for p in ckpt.iterdir())
        print(
            f"checkpoint: {total / GIB:.3f} GiB in {work}; {os.cpu_count()} cores, load average "
            f"{os.getloadavg()[0]:.1f}; every measurement runs {args.repeat}x, interleaved, best kept"
        )
        key = Identity.generate()
        publish(
            ckpt, step=1, identity=key, out_dir=work / "origin", shard_size=args.shard_size, run_id="bench"
        )
        urls = []
        for _ in range(3):
            proc, url = start_our_server(work / "origin")
            servers.append(proc)
            urls.append(url)
        shardcast_error = "skipped (--skip-shardcast)" if args.skip_shardcast else ""
        if not args.skip_shardcast:
            try:
                shardcast = Shardcast(ensure_shardcast(args.shardcast_venv), model, work)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                shardcast_error = f"NOT MEASURED: {exc}"
        # Round-robin, so that load from other processes on this machine falls on every contender alike.
        best: dict[str, float] = {}
        costs: dict[str, float] = {}
        pids = [proc.pid for proc in servers]
        for _ in range(args.repeat):
            for name, cost in cpu_costs(model, work).items():  # the cheapest run: the least disturbed
                costs[name] = min(costs.get(name, float("inf")), cost)
            runs = {
                "loopback": lambda: model.stat().st_size / measure_loopback(model),
                "sha256": lambda: model.stat().st_size / measure_sha256(model),
                "ours x1": lambda: fetch_ours(urls[:1], key.node_id, work / "out", pids[:1], "ours x1"),
                "ours x3": lambda: fetch_ours(urls, key.node_id, work / "out", pids, "ours x3"),
            }
            if shardcast is not None:
                runs["shardcast"] = shardcast.fetch_once
            for name, run in runs.items():
                try:
                    best[name] = min(best.get(name, float("inf")), run())
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    if name != "shardcast":
                        raise
                    shardcast_error = f"NOT MEASURED: {exc}"
                    best.pop("shardcast", None)
                    assert shardcast is not None
                    shardcast.stop()
                    shardcast = None
        loopback, sha = model.stat().st_size / best["loopback"], model.stat().st_size / best["sha256"]
        limit = min(loopback, sha)
        one, three = best["ours x1"], best["ours x3"]
        ours = min(one, three)
        print(f"raw loopback      {loopback / MIB:8.0f} MiB/s")
        print(f"SHA-256 all cores {sha / MIB:8.0f} MiB/s   -> limit {limit / MIB:.0f} MiB/s")
        print(
            f"ours, 1 source    {total / one / MIB:8.0f} MiB/s   ({one:.2f} s, verified, fsync'ed, in place)"
        )
        print(f"ours, 3 sources   {total / three / MIB:8.0f} MiB/s   ({three:.2f} s)")
        shardcast_s = best.get("shardcast")
        if shardcast_s is not None and shardcast is not None:
            print(
                f"shardcast         {model.stat().st_size / shardcast_s / MIB:8.0f} MiB/s   ({shardcast_s:.2f} s, "
                "model file only, blake3-checked)"
            )
        else:
            shardcast_s = None
            print(f"shardcast         {shardcast_error}")
        print("\nratios (throughput)")
        if shardcast_s is not None:
            sc_rate = model.stat().st_size / shardcast_s
            print(f"  ours x1 / shardcast     {total / one / sc_rate:6.2f}x   (target >= 2x)")
            print(f"  ours x3 / shardcast     {total / three / sc_rate:6.2f}x")
        print(f"  ours best / limit       {total / ours / limit:6.2f}")
        cores = os.cpu_count() or 1
        budget = sum(costs.values())
        physical = cores / budget * GIB  # bytes/s
        parts = ", ".join(f"{name} {cost:.2f}" for name, cost in costs.items())
        print(
            f"\nCPU budget per GiB (core-seconds, each measured alone): {parts}; sum {budget:.2f}\n"
            f"physical limit on {cores} cores: {physical / MIB:.0f} MiB/s (cores / sum)\n"
            f"  ours x1 / physical      {total / one / physical:6.2f}    (target >= 0.85)\n"
            f"  ours x3 / physical      {total / three / physical:6.2f}"
        )
        # Wall-clock throughput needs the cores to ourselves; on a shared machine the same comparison in CPU
        # terms says how close the fetch's own work (fetcher + servers) comes to the budget's.
        for name in ("ours x1", "ours x3"):
            spent = CPU_SPENT[name] * GIB / total
            print(
                f"  {name}: {spent:.2f} core-seconds per GiB (fetcher + servers), budget / ours "
                f"{budget / spent:.2f}; with the cores to itself: {cores / spent * GIB / MIB:.0f} MiB/s"
            )
        print(f"  ours x3 / ours x1       {one / three:6.2f}x")
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
        if args.profile is not None:
            profile_fetch(urls[0], key.node_id, work / "out", args.profile, total)
        return 0
    finally:
        if shardcast is not None:
            shardcast.stop()
        for proc in servers:
            proc.send_signal(signal.SIGTERM)
        for proc in servers:
            wait_or_kill(proc, 15)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
