"""Helpers for the weights tests: small real checkpoints, real servers on 127.0.0.1, and hostile sources.

`HostileSource` is a real aiohttp server that answers the weights endpoints with the genuine manifest and
shard bytes from a store, except where told to misbehave (flip a bit, send the wrong length, stall, die
mid-transfer with or without sending zeros first, answer 404 or HTML, withdraw the version, serve another
manifest). Its `fault` may be changed while it runs, or limited to its first `fault_limit` faulty answers (a
source that heals). It is the adversary, not a mock of the code
under test: the fetcher and relay talk to it over real sockets exactly as they talk to an honest server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
from aiohttp import web
from safetensors.numpy import save_file

from prime_node.p2p.identity import Identity
from prime_node.p2p.weights.manifest import SignedManifest
from prime_node.p2p.weights.publish import publish
from prime_node.p2p.weights.server import ServeSettings, WeightsServer
from prime_node.p2p.weights.store import Store

from support.port_process import port_process

SHARD = 64 << 10  # small shards so that a 1-2 MB checkpoint has tens of them


def operator(seed: int = 7) -> Identity:
    return Identity.from_seed(bytes([seed]) * 32)


def make_checkpoint(directory: Path, *, seed: int = 0, megabytes: float = 1.5) -> Path:
    """A small HF-style directory: config.json, a real safetensors file, tokenizer files in a subfolder."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(f'{{"model_type": "qwen2", "seed": {seed}}}')
    n = int(megabytes * 2**20 / 4 / 2)
    save_file(
        {
            "embed.weight": rng.standard_normal(n).astype(np.float32),
            "lm_head.weight": rng.standard_normal(n).astype(np.float32),
        },
        str(directory / "model.safetensors"),
    )
    (directory / "tokenizer").mkdir(exist_ok=True)
    (directory / "tokenizer" / "tokenizer.json").write_bytes(os.urandom(3000 + seed))
    return directory


def publish_steps(
    root: Path, key: Identity, steps: list[int], *, megabytes: float = 1.5
) -> dict[int, SignedManifest]:
    out = {}
    for step in steps:
        ckpt = make_checkpoint(root / f"src-{step}", seed=step, megabytes=megabytes)
        out[step], _ = publish(
            ckpt, step=step, identity=key, out_dir=root / "origin", shard_size=SHARD, run_id="test"
        )
    return out


def same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all((a / f).read_bytes() == (b / f).read_bytes() for f in files_a)


@contextlib.asynccontextmanager
async def serving(
    store_dir: Path, trusted_key: str | None = None, *, identity: Identity | None = None, **settings: object
) -> AsyncIterator[WeightsServer]:
    """A real weights server over `store_dir` on 127.0.0.1 (signing availability records as `identity`)."""
    server = WeightsServer(
        Store(store_dir),
        ServeSettings(**{"port": 0, **settings}),  # type: ignore[arg-type]
        trusted_key,
        identity=identity,
    )
    server.url = await server.start()  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        await server.stop()


class HostileSource:
    """A real HTTP source for one stored version with one chosen misbehaviour on chosen shards."""

    def __init__(
        self,
        store_dir: Path,
        step: int,
        fault: str | None = None,
        *,
        shards: set[int] | None = None,
        manifest_bytes: bytes | None = None,
        chunk_delay_s: float = 0.0,
        availability: bytes | None = None,
        availability_delay_s: float = 0.0,
        fault_limit: int | None = None,
    ) -> None:
        self.store = Store(store_dir)
        self.step = step
        self.fault = fault
        self.fault_shards = shards  # None: every shard
        self.manifest_bytes = manifest_bytes or self.store.manifest_bytes(step)
        self.manifest = self.store.load_manifest(step, None)
        self.chunk_delay_s = chunk_delay_s
        self.availability = availability  # served as its availability record when set (404 otherwise)
        self.availability_delay_s = availability_delay_s  # each availability answer comes this late
        self.availability_requests = 0
        self.fault_limit = fault_limit  # None: every faulty shard, every time
        self.faults = 0  # faulty answers given so far
        self.withdrawn = False  # "withdrawn" answered: the version is gone, availability included
        self.requests: Counter[int] = Counter()
        self.ranges: list[tuple[int, str]] = []
        self._stalled: list[asyncio.Event] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    def _shard_bytes(self, index: int) -> bytes:
        directory = self.store.checkpoint_dir(self.step)
        parts = []
        for seg in self.manifest.segments(index):
            with open(directory / self.manifest.body.files[seg.file_index].path, "rb") as f:
                f.seek(seg.file_offset)
                parts.append(f.read(seg.length))
        return b"".join(parts)

    async def _manifest(self, request: web.Request) -> web.Response:
        if self.fault == "html-manifest":
            return web.Response(text="<html><body>Welcome to nginx</body></html>", content_type="text/html")
        if self.fault == "404-manifest":
            return web.Response(status=404, text="not found")
        return web.Response(body=self.manifest_bytes, content_type="application/json")

    async def _shard(self, request: web.Request) -> web.StreamResponse:
        index = int(request.match_info["index"])
        self.requests[index] += 1
        data = self._shard_bytes(index)
        if "Range" in request.headers:
            self.ranges.append((index, request.headers["Range"]))
            start = int(request.headers["Range"].split("=")[1].split("-")[0])
        else:
            start = 0
        faulty = self.fault is not None and (self.fault_shards is None or index in self.fault_shards)
        if faulty and self.fault_limit is not None and self.faults >= self.fault_limit:
            faulty = False
        self.faults += faulty
        fault = self.fault if faulty else None
        if fault == "withdrawn":  # what server.py answers once it dropped or pruned the version
            self.withdrawn = True
            return web.json_response({"error": "no such version"}, status=404)
        if fault == "404":
            return web.Response(status=404, text="no such shard")
        if fault == "503":
            return web.Response(status=503, text="not verified here yet", headers={"Retry-After": "1"})
        if fault == "busy":  # every upload slot taken (p2p/weights/server.py upload_slots)
            headers = {"Retry-After": "0.5", "X-Prime-Node-Busy": "upload slots"}
            return web.Response(status=503, text="every upload slot is busy", headers=headers)
        if fault == "html":
            return web.Response(text="<html>rate limited, try later</html>", content_type="text/html")
        if fault == "flip":
            data = data[:10] + bytes([data[10] ^ 0x01]) + data[11:]
        elif fault == "short":
            data = data[:-1]
        elif fault == "long":
            data = data + b"\0"
        body = data[start:]
        resp = web.StreamResponse(status=206 if start else 200)
        resp.content_type = "application/octet-stream"
        resp.content_length = len(body)
        if start:
            resp.headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        await resp.prepare(request)
        if fault in ("stall", "die", "garbage-die"):
            half = len(body) // 2
            await resp.write(bytes(half) if fault == "garbage-die" else body[:half])
            if fault in ("die", "garbage-die"):
                assert request.transport is not None
                request.transport.abort()  # the source process dies: connection reset mid-body
                return resp
            event = asyncio.Event()
            self._stalled.append(event)
            await event.wait()  # hold the connection open, sending nothing, until the test ends
            return resp
        step = max(1, len(body) // 8)
        for pos in range(0, len(body), step):
            await resp.write(body[pos : pos + step])
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
        await resp.write_eof()
        return resp

    async def _availability(self, request: web.Request) -> web.Response:
        self.availability_requests += 1
        if self.availability_delay_s:
            await asyncio.sleep(self.availability_delay_s)
        if self.withdrawn:
            return web.json_response({"error": "no such version"}, status=404)
        if self.availability is None:
            return web.Response(status=404, text="no availability records here")
        return web.Response(body=self.availability, content_type="application/json")

    @property
    def stalled(self) -> int:
        """Transfers that sent their half and now hold the connection open (the "stall" fault)."""
        return len(self._stalled)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get(r"/v1/weights/{step:\d+}/availability", self._availability)
        app.router.add_get("/v1/weights/latest", self._manifest)
        app.router.add_get(r"/v1/weights/{step:\d+}/manifest", self._manifest)
        app.router.add_get(r"/v1/weights/{step:\d+}/shards/{index:\d+}", self._shard)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        for event in self._stalled:
            event.set()
        if self._runner is not None:
            await self._runner.cleanup()


@contextlib.asynccontextmanager
async def hostile(
    store_dir: Path, step: int, fault: str | None = None, **kwargs: object
) -> AsyncIterator[HostileSource]:
    source = HostileSource(store_dir, step, fault, **kwargs)  # type: ignore[arg-type]
    await source.start()
    try:
        yield source
    finally:
        await source.stop()


HOSTILE_SERVER = Path(__file__).with_name("hostile_http.py")


@contextlib.contextmanager
def hostile_process(store_dir: Path, *, interval: float = 0.2) -> Iterator[str]:
    """Run tests/support/hostile_http.py in its own process over `store_dir`; yields its base URL (add `/<mode>`)."""
    argv = [sys.executable, str(HOSTILE_SERVER), str(store_dir), "--interval", str(interval)]
    with port_process(argv, "the hostile server") as url:
        yield url


HOSTILE_CLIENT = Path(__file__).with_name("hostile_client.py")


class HostileClients:
    """A running tests/support/hostile_client.py: `result()` waits for its report (see its docstring)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def result(self, timeout: float) -> dict[str, list]:
        assert self.proc.stdout is not None
        ready = select.select([self.proc.stdout], [], [], timeout)[0]
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("{"):
            raise RuntimeError(f"the hostile clients did not report within {timeout} s (said {line!r})")
        return json.loads(line)


@contextlib.contextmanager
def hostile_clients(
    url: str,
    mode: str,
    count: int,
    *,
    source_ip: str,
    path: str = "/v1/weights/latest",
    duration: float = 10.0,
) -> Iterator[HostileClients]:
    """Open `count` hostile connections to `url` from `source_ip` in their own process (returns once open)."""
    argv = [sys.executable, str(HOSTILE_CLIENT), url, mode, str(count), "--source-ip", source_ip]
    argv += ["--path", path, "--for", str(duration)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = select.select([proc.stdout], [], [], 30)[0]
        line = proc.stdout.readline() if ready else ""
        if line.strip() != "READY":
            raise RuntimeError(f"the hostile clients did not start (said {line!r})")
        yield HostileClients(proc)
    finally:
        proc.kill()  # by its pid: only the process this helper started
        proc.wait(10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
