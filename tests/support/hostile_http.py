"""A hostile weights source: a raw HTTP/1.1 server, run as its own process, that misbehaves on purpose.

    python tests/support/hostile_http.py STORE_DIR [--interval S]

It prints `PORT <n>` once listening on 127.0.0.1 and serves until killed. Every mode lives under its own path
prefix, so one process is many sources: `http://127.0.0.1:<n>/<mode>` is a source base URL (`<mode>~<k>` is
the same mode under another URL, for many sources of one kind), and the fetcher
asks it for `/<mode>/v1/weights/...` as it asks any server. The content is the genuine signed manifests and
shard bytes of the versions in STORE_DIR (a prime-node store; `latest` is its highest step, and a version
published there later is served too), except where the mode says otherwise; modes starting
with `m-` break the manifest response and serve honest shards, modes starting with `s-` serve the honest
manifest and break every shard response. `GET <base URL>/requests` answers `{"shards": <n>}`, the shard
requests that source has received. It writes raw bytes to the socket (no HTTP library), so it can say
what no well-behaved library would: `Content-Length: ²` (0xB2, what `str.isdigit()` accepts), headers that
never end, a body that drips one byte at a time. Standard library only, so it starts in a few milliseconds.
"""

from __future__ import annotations

import argparse
import json
import socket
import socketserver
import sys
import threading
import time
from pathlib import Path

MANIFEST_MODES = {
    "m-unicode-length": "Content-Length: ² (a Latin-1 superscript two: isdigit() is True, int() raises)",
    "m-huge-length": "Content-Length of 26 digits",
    "m-negative-length": "Content-Length: -1",
    "m-two-lengths": "two Content-Length headers",
    "m-no-length": "no Content-Length: the body runs until the connection closes",
    "m-surrogate-json": "a manifest whose body holds a lone UTF-16 surrogate (valid JSON, not encodable UTF-8)",
    "m-garbage-json": "bytes that are not JSON",
    "m-drip-body": "honest headers, then the manifest one byte per interval",
    "m-drip-headers": "a status line, then one header byte per interval, for ever",
    "m-endless-continue": "'100 Continue' interim responses, one per interval, for ever",
    "m-many-headers": "a thousand headers",
    "m-stall": "reads the request and never answers",
    "m-close": "closes the connection without answering",
    "m-redirect": "302 to another address",
    "m-503-nan": "503 with Retry-After: NaN, for ever",
    "m-bad-status": "a status line that is not HTTP",
}
SHARD_MODES = {
    "s-unicode-length": "Content-Length: ²",
    "s-huge-length": "Content-Length of 26 digits",
    "s-negative-length": "Content-Length: -1",
    "s-no-length": "no Content-Length (connection close)",
    "s-chunked-bad": "Transfer-Encoding: chunked with a chunk size that is not hex",
    "s-drip": "honest headers, then the shard one byte per interval",
    "s-drip-headers": "a status line, then one header byte per interval, for ever",
    "s-endless-continue": "'100 Continue' interim responses, one per interval, for ever",
    "s-stall": "honest headers and half the shard, then silence",
    "s-wrong-bytes": "the shard at full speed with one byte flipped",
    "s-503-nan": "503 with Retry-After: NaN, for ever",
    "s-503-huge": "503 with a Retry-After of 20 digits, for ever",
    "s-503-unicode": "503 with Retry-After: ², for ever",
    "s-503-seed": "503 with Retry-After: 0 and X-Prime-Node-Seed naming the next shard (cycling), for ever: a "
    "super-seeding origin's hint, given for every request",
    "s-503-zero": "503 'shard not verified here yet' with Retry-After: 0 and no hint, for ever: what a relay still "
    "mirroring says (with Retry-After: 1), given for every shard at once",
    "s-redirect": "302 to another address",
    "s-slow": "the honest shard, 1 KiB per interval (slow, but a correct source)",
    # Resume poisoning: bytes that are kept on disk when the transfer breaks off, for a later one to continue.
    "s-garbage-close": "an honest head (200, or 206 for a Range), 8 KiB of garbage, then it hangs up",
    "s-garbage-stall": "an honest head, 8 KiB of garbage, then silence (held until cut)",
    "s-garbage-resume": "garbage then hang up from byte 0; the honest rest for a Range (its own resume fails)",
    "s-range-shifted": "half the honest shard then hang up; a Range is answered from byte 0 under the asked "
    "Content-Range (its own resume fails)",
}
GARBAGE_BYTES = 8 << 10
SEED = "X-Prime-Node-Seed"  # p2p/weights/seeding.py SEED_HEADER (standard library only here)
EMPTY = [("Content-Length", "0")]
MODES = {**MANIFEST_MODES, **SHARD_MODES}
MAX_REQUEST_HEAD = 16 << 10


class Content:
    """The genuine manifest and shard bytes of one stored version."""

    def __init__(self, store: Path, step: int) -> None:
        version = store / f"step-{step:012d}"
        self.manifest = (version / "manifest.json").read_bytes()
        body = json.loads(self.manifest)["body"]
        stream = b"".join((version / "checkpoint" / f["path"]).read_bytes() for f in body["files"])
        size = body["shard_size"]
        self.shards = [stream[i * size : (i + 1) * size] for i in range(len(body["shards"]))]
        self.step = step


class Versions:
    """Every version of a store, read when first asked for."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self._cache: dict[int, Content] = {}
        self._lock = threading.Lock()

    def latest(self) -> int | None:
        steps = [int(p.name[5:]) for p in self.store.glob("step-*") if (p / "manifest.json").is_file()]
        return max(steps) if steps else None

    def get(self, step: int) -> Content | None:
        with self._lock:
            if step not in self._cache:
                if not (self.store / f"step-{step:012d}" / "manifest.json").is_file():
                    return None
                self._cache[step] = Content(self.store, step)
            return self._cache[step]


def head(status: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def partial_head(ctype: str, start: int, total: int) -> bytes:
    return head(
        "206 Partial Content",
        [
            ("Content-Type", ctype),
            ("Content-Length", str(total - start)),
            ("Content-Range", f"bytes {start}-{total - 1}/{total}"),
        ],
    )


class Handler(socketserver.BaseRequestHandler):
    server: HostileServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(300)
        buffered = b""
        try:
            while True:  # keep-alive: one request after another until a mode breaks the framing
                while b"\r\n\r\n" not in buffered:
                    data = sock.recv(65536)
                    if not data or len(buffered) > MAX_REQUEST_HEAD:
                        return
                    buffered += data
                raw, buffered = buffered.split(b"\r\n\r\n", 1)
                request_line, *header_lines = raw.decode("latin-1").split("\r\n")
                path = request_line.split(" ")[1]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, v in (h.split(":", 1) for h in header_lines if ":" in h)
                }
                if not self.answer(sock, path, headers.get("range")):
                    return
        except OSError:
            return

    def answer(self, sock: socket.socket, path: str, range_header: str | None) -> bool:
        """Answer one request; False when the connection must end (the mode broke the framing)."""
        parts = path.strip("/").split("/")
        mode, rest = parts[0].split("~")[0], parts[1:]
        if rest == ["requests"]:  # how many shard requests this source (`<mode>~<k>`) received, for the tests
            with self.server.lock:
                doc = json.dumps({"shards": self.server.shard_requests.get(parts[0], 0)}).encode()
            sock.sendall(head("200 OK", [("Content-Length", str(len(doc)))]) + doc)
            return True
        if len(rest) == 5 and rest[3] == "shards":
            with self.server.lock:
                self.server.shard_requests[parts[0]] = self.server.shard_requests.get(parts[0], 0) + 1
        interval = self.server.interval
        asked = rest[2] if len(rest) > 2 else ""
        step = int(asked) if asked.isascii() and asked.isdigit() else None
        if asked == "latest":
            step = self.server.versions.latest()
        content = self.server.versions.get(step) if step is not None else None
        if mode not in MODES and mode != "honest" or rest[:2] != ["v1", "weights"] or content is None:
            sock.sendall(head("404 Not Found", [("Content-Length", "0")]))
            return True
        if rest[2:] in (["latest"], [str(content.step), "manifest"]):
            body, broken = content.manifest, mode if mode.startswith("m-") else None
            ctype = "application/json"
        elif (
            len(rest) == 5
            and rest[2] == str(content.step)
            and rest[3] == "shards"
            and rest[4].isascii()
            and rest[4].isdigit()
            and int(rest[4]) < len(content.shards)
        ):
            body, broken = content.shards[int(rest[4])], mode if mode.startswith("s-") else None
            ctype = "application/octet-stream"
            start = int(range_header.removeprefix("bytes=").split("-")[0]) if range_header else 0
            if broken in ("s-garbage-close", "s-garbage-stall", "s-garbage-resume", "s-range-shifted"):
                return self.poison(sock, broken, body, start)
            if broken == "s-503-seed":
                # A super-seeding origin's hint (p2p/weights/seeding.py) for every request, the next shard
                # round the ring: a fetcher that took every hint would ask this source for ever.
                hinted = (int(rest[4]) + 1) % len(content.shards)
                sock.sendall(
                    head("503 Service Unavailable", [*EMPTY, ("Retry-After", "0"), (SEED, str(hinted))])
                )
                return True
            if broken == "s-503-zero":
                # A relay's "not verified here yet" (p2p/weights/server.py `_wait_for`) for every shard, with no
                # wait before it and no pause asked for: a fetcher that asked again at once would for ever.
                doc = b'{"error": "shard not verified here yet"}'
                answer = [("Content-Length", str(len(doc))), ("Retry-After", "0")]
                sock.sendall(head("503 Service Unavailable", answer) + doc)
                return True
            if range_header and broken is None:
                sock.sendall(partial_head(ctype, start, len(body)) + body[start:])
                return True
        else:
            sock.sendall(head("404 Not Found", [("Content-Length", "0")]))
            return True
        if broken is None:
            sock.sendall(head("200 OK", [("Content-Type", ctype), ("Content-Length", str(len(body)))]) + body)
            return True
        return self.misbehave(sock, broken.split("-", 1)[1], body, ctype, interval)

    def poison(self, sock: socket.socket, mode: str, body: bytes, start: int) -> bool:
        """Leave bytes on the fetcher's disk that do not belong there, for a later transfer to continue."""
        ctype = "application/octet-stream"
        answer = (
            partial_head(ctype, start, len(body))
            if start
            else head("200 OK", [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        )
        garbage = bytes((i * 7 + 13) % 251 for i in range(min(GARBAGE_BYTES, len(body) - start - 1)))
        if mode == "s-garbage-resume" and start:
            sock.sendall(answer + body[start:])  # the honest rest: the digest fails over its own garbage
            return True
        if mode == "s-range-shifted":
            # From byte 0: the honest first half, then hang up; for a Range, bytes from 0 under its header.
            sock.sendall(answer + (body[: len(body) - start] if start else body[: len(body) // 2]))
            return bool(start)
        sock.sendall(answer + garbage)
        if mode == "s-garbage-stall":
            time.sleep(3600)
        return False

    def misbehave(self, sock: socket.socket, fault: str, body: bytes, ctype: str, interval: float) -> bool:
        ok = [("Content-Type", ctype)]
        if fault == "unicode-length":
            raw_head = (
                b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype.encode() + b"\r\nContent-Length: \xb2\r\n\r\n"
            )
            sock.sendall(raw_head + body)
        elif fault == "huge-length":
            sock.sendall(head("200 OK", ok + [("Content-Length", "9" * 26)]) + body)
        elif fault == "negative-length":
            sock.sendall(head("200 OK", ok + [("Content-Length", "-1")]) + body)
        elif fault == "two-lengths":
            sock.sendall(
                head("200 OK", ok + [("Content-Length", str(len(body))), ("Content-Length", "7")]) + body
            )
        elif fault == "no-length":
            sock.sendall(head("200 OK", ok + [("Connection", "close")]) + body)
        elif fault == "surrogate-json":
            doc = (
                b'{"body": {"format": "prime-node-weights", "note": "\\ud800"}, "signature": "'
                + b"ab" * 64
                + b'"}'
            )
            sock.sendall(head("200 OK", ok + [("Content-Length", str(len(doc)))]) + doc)
            return True
        elif fault == "garbage-json":
            junk = b"\xff\xfe{{not json" * 50
            sock.sendall(head("200 OK", ok + [("Content-Length", str(len(junk)))]) + junk)
            return True
        elif fault in ("drip-body", "drip"):
            sock.sendall(head("200 OK", ok + [("Content-Length", str(len(body)))]))
            for i in range(len(body)):
                time.sleep(interval)
                sock.sendall(body[i : i + 1])
            return True
        elif fault == "drip-headers":
            sock.sendall(b"HTTP/1.1 200 OK\r\nX-Padding: ")
            while True:
                time.sleep(interval)
                sock.sendall(b"a")
        elif fault == "endless-continue":
            while True:
                sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                time.sleep(interval)
        elif fault == "many-headers":
            padding = [(f"X-{i}", "x") for i in range(1000)]
            sock.sendall(head("200 OK", ok + padding + [("Content-Length", str(len(body)))]) + body)
        elif fault == "stall":
            if ctype == "application/octet-stream":
                sock.sendall(
                    head("200 OK", ok + [("Content-Length", str(len(body)))]) + body[: len(body) // 2]
                )
            time.sleep(3600)
        elif fault == "close":
            pass
        elif fault == "redirect":
            sock.sendall(
                head(
                    "302 Found",
                    [("Location", "http://127.0.0.1:9/v1/weights/latest"), ("Content-Length", "0")],
                )
            )
            return True
        elif fault in ("503-nan", "503-huge", "503-unicode"):
            retry = {"503-nan": b"NaN", "503-huge": b"9" * 20, "503-unicode": b"\xb2"}[fault]
            sock.sendall(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: "
                + retry
                + b"\r\n\r\n"
            )
            return True
        elif fault == "bad-status":
            sock.sendall(b"HTTQ/9 OK maybe\r\n\r\n")
        elif fault == "chunked-bad":
            sock.sendall(
                head("200 OK", ok + [("Transfer-Encoding", "chunked")]) + b"zz\r\n" + body + b"\r\n0\r\n\r\n"
            )
        elif fault == "wrong-bytes":
            wrong = body[:10] + bytes([body[10] ^ 0x01]) + body[11:]
            sock.sendall(head("200 OK", ok + [("Content-Length", str(len(wrong)))]) + wrong)
            return True
        elif fault == "slow":
            sock.sendall(head("200 OK", ok + [("Content-Length", str(len(body)))]))
            for pos in range(0, len(body), 1024):
                time.sleep(interval)
                sock.sendall(body[pos : pos + 1024])
            return True
        return False


class HostileServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, versions: Versions, interval: float) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.versions = versions
        self.interval = interval
        self.lock = threading.Lock()
        self.shard_requests: dict[str, int] = {}  # source path (`<mode>~<k>`) -> shard requests received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between dripped bytes")
    args = parser.parse_args()
    server = HostileServer(Versions(args.store), args.interval)
    print(f"PORT {server.server_address[1]}", flush=True)
    threading.Thread(target=server.serve_forever, name="hostile-http", daemon=True).start()
    try:
        sys.stdin.read()  # the parent ends us by closing our stdin (or by killing our pid)
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
