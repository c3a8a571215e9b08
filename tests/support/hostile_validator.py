"""A hostile validator API: a raw HTTP/1.1 server, run as its own process, that misbehaves on purpose.

    python tests/support/hostile_validator.py [--interval S]

It prints `PORT <n>` once listening on 127.0.0.1 and serves until its stdin closes or it is killed. Every
mode lives under its own path prefix, so one process is many validators: `http://127.0.0.1:<n>/<mode>` is a
validator base URL, and a client asks it `/<mode>/api/leaderboard?top=N` or `/<mode>/api/node/<id>` as it
asks any validator. The `honest` mode answers what a real validator would (one ranked node, NODE); every
other mode breaks one thing, in the answer's bytes (a number no date can hold, a NaN, a control character,
a wrong type) or in its transport (a body or headers dripped a byte per interval, a stall, a body over the
client's limit, headers no HTTP library accepts). Raw sockets, no HTTP library, standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

NODE = "ab" * 32
T = 1_800_000_000.0
ROW = {
    "rank": 1,
    "node_id": NODE,
    "accepted_tokens": 5000,
    "accepted_samples": 16,
    "accepted_files": 2,
    "rejected_files": 1,
    "score": 1.5,
    "slashes": 1,
    "slashed": 5.0,
    "banned": True,
    "ban_permanent": False,
    "banned_until": T + 3600,
    "last_step": 3,
    "first_seen": T - 60,
    "last_seen": T,
    "hardware": {"gpu_model": "NVIDIA H100", "cpu_cores": 16},
}
RECENT = {
    "file_hash": "cd" * 32,
    "step": 3,
    "samples": 4,
    "tokens": 100,
    "accepted": False,
    "failed_check": "sampling",
    "reason": "row 0: token 5 was not sampled from the policy",
    "decided_at": T,
}


class Raw(str):
    """A JSON literal written as is (json.dumps cannot write a 5,000-digit integer)."""


# Modes that change the row (of the leaderboard and of the node entry alike): field -> value.
ROW_MODES: dict[str, tuple[str, object]] = {
    "huge-time": ("banned_until", 1e300),  # datetime.fromtimestamp(1e300): OverflowError
    "negative-time": ("banned_until", -1e300),
    "huge-last-seen": ("last_seen", 1e300),
    "nan": ("score", float("nan")),  # json.dumps writes NaN and Infinity, as a careless server would
    "infinity": ("slashed", float("inf")),
    "control": ("hardware", {"gpu_model": "\x1b[2J\x1b[31mEVIL\x07"}),  # clears the screen, rings the bell
    "bidi": ("hardware", {"cpu": "safe\u202egnp.exe"}),
    "surrogate": ("hardware", {"cpu": "\ud800"}),
    "wrong-type": ("node_id", 12345),
    "bool-as-int": ("rank", True),
    "string-number": ("accepted_tokens", "5000"),
    "huge-int": ("rank", Raw("9" * 5000)),
}
DOC_MODES = {
    "nodes-object": "the leaderboard's nodes (the node entry's node) as an object of the wrong shape",
    "reason-control": "a recent verdict's reason that sets the terminal's title",
    "not-json": "bytes that are not JSON",
    "top-level-list": "a JSON list instead of an object",
    "deep": "JSON nested 100,000 levels deep",
}
TRANSPORT_MODES = {
    "drip-body": "honest headers, then the body one byte per interval",
    "drip-headers": "a status line, then one header byte per interval, for ever",
    "stall": "reads the request and never answers",
    "endless-continue": "'100 Continue' interim responses, one per interval, for ever",
    "oversize": "17 MiB of body without a Content-Length (over the client's 16 MiB leaderboard limit)",
    "huge-length": "a Content-Length of 26 digits",
    "unicode-length": "Content-Length: ² (a Latin-1 superscript two)",
    "many-headers": "a thousand headers",
    "bad-status": "a status line that is not HTTP",
    "gzip-bomb": "Content-Encoding: gzip over 64 MiB of zeros",
    "redirect": "302 to another address",
    "error-control": "404 whose error text holds escape sequences",
    "close": "closes the connection without answering",
}
MODES = [*ROW_MODES, *DOC_MODES, *TRANSPORT_MODES]
NODE_ONLY = {"reason-control"}  # modes that break only the node entry: the leaderboard stays honest
MAX_REQUEST_HEAD = 16 << 10


def head(status: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def document(mode: str, route: str) -> bytes:
    """The answer's body: a leaderboard or a node entry, honest or broken as `mode` says."""
    row: dict[str, object] = dict(ROW)
    recent = dict(RECENT)
    raw: str | None = None
    if mode in ROW_MODES:
        field, value = ROW_MODES[mode]
        raw = value if isinstance(value, Raw) else None
        row[field] = "@@raw@@" if raw is not None else value
    if mode == "reason-control":
        recent["reason"] = "fine\x1b]0;owned\x07"
    if route == "leaderboard":
        doc: object = {"generated_at": T, "ranked": 1, "nodes": [row]}
        if mode == "nodes-object":
            doc = {"generated_at": T, "ranked": 1, "nodes": {"0": row}}
    else:
        doc = {"node": row, "ranked": 1, "recent": [recent], "slash_log": [], "bans": []}
        if mode == "nodes-object":
            doc = {"node": [row], "ranked": 1, "recent": [], "slash_log": [], "bans": []}
    if mode == "top-level-list":
        doc = [doc]
    if mode == "not-json":
        return b"\xff\xfe{{not json" * 20
    if mode == "deep":
        return b"[" * 100_000 + b"]" * 100_000
    text = json.dumps(doc)
    return (text.replace('"@@raw@@"', raw) if raw is not None else text).encode()


_BOMB: list[bytes] = []


def gzip_bomb() -> bytes:
    if not _BOMB:
        _BOMB.append(gzip.compress(b"\0" * (64 << 20), compresslevel=9))
    return _BOMB[0]


class Handler(socketserver.BaseRequestHandler):
    server: HostileValidator

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(300)
        buffered = b""
        try:
            while b"\r\n\r\n" not in buffered:
                data = sock.recv(65536)
                if not data or len(buffered) > MAX_REQUEST_HEAD:
                    return
                buffered += data
            path = buffered.split(b"\r\n", 1)[0].decode("latin-1").split(" ")[1]
            self.answer(sock, path)
        except OSError:
            return

    def answer(self, sock: socket.socket, path: str) -> None:
        mode, _, rest = path.strip("/").partition("/")
        route = "leaderboard" if rest.startswith("api/leaderboard") else "node"
        if mode not in MODES and mode != "honest" or not rest.startswith(("api/leaderboard", "api/node/")):
            body = b'{"error": "no such route"}'
            sock.sendall(head("404 Not Found", [("Content-Length", str(len(body)))]) + body)
            return
        body = document(mode, route)
        ok = [("Content-Type", "application/json"), ("Connection", "close")]
        interval = self.server.interval
        if mode not in TRANSPORT_MODES:
            sock.sendall(head("200 OK", ok + [("Content-Length", str(len(body)))]) + body)
        elif mode == "drip-body":
            sock.sendall(head("200 OK", ok + [("Content-Length", str(len(body)))]))
            for i in range(len(body)):
                time.sleep(interval)
                sock.sendall(body[i : i + 1])
        elif mode == "drip-headers":
            sock.sendall(b"HTTP/1.1 200 OK\r\nX-Padding: ")
            while True:
                time.sleep(interval)
                sock.sendall(b"a")
        elif mode == "stall":
            time.sleep(3600)
        elif mode == "endless-continue":
            while True:
                sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                time.sleep(interval)
        elif mode == "oversize":
            sock.sendall(head("200 OK", ok))
            chunk = b" " * (1 << 20)
            for _ in range(17):
                sock.sendall(chunk)
        elif mode == "huge-length":
            sock.sendall(head("200 OK", ok + [("Content-Length", "9" * 26)]) + body)
        elif mode == "unicode-length":
            sock.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: \xb2\r\n\r\n" + body
            )
        elif mode == "many-headers":
            padding = [(f"X-{i}", "x") for i in range(1000)]
            sock.sendall(head("200 OK", ok + padding + [("Content-Length", str(len(body)))]) + body)
        elif mode == "bad-status":
            sock.sendall(b"HTTP/1.1 \x1b[31mTEAPOT\r\n\r\n" + body)
        elif mode == "gzip-bomb":
            bomb = gzip_bomb()
            sock.sendall(
                head("200 OK", ok + [("Content-Encoding", "gzip"), ("Content-Length", str(len(bomb)))]) + bomb
            )
        elif mode == "redirect":
            sock.sendall(head("302 Found", [("Location", "http://127.0.0.1:1/"), ("Content-Length", "0")]))
        elif mode == "error-control":
            text = json.dumps({"error": "no node \x1b[2J\x1b]0;owned\x07 here"}).encode()
            sock.sendall(head("404 Not Found", [("Content-Length", str(len(text)))]) + text)
        elif mode == "close":
            return


class HostileValidator(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, interval: float) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.interval = interval


@contextlib.contextmanager
def hostile_validator(*, interval: float = 0.2) -> Iterator[str]:
    """Run this module in its own process; yields its base URL (add `/<mode>`), ends it by its pid."""
    from support.port_process import (
        port_process,  # here: this module also runs as a script, without `support`
    )

    argv = [sys.executable, str(Path(__file__)), "--interval", str(interval)]
    with port_process(argv, "the hostile validator") as url:
        yield url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between dripped bytes")
    args = parser.parse_args()
    server = HostileValidator(args.interval)
    print(f"PORT {server.server_address[1]}", flush=True)
    threading.Thread(target=server.serve_forever, name="hostile-validator", daemon=True).start()
    try:
        sys.stdin.read()  # the parent ends us by closing our stdin (or by killing our pid)
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
