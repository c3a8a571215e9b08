"""Hostile clients of a weights server, run as their own process: connections that cost the server, not them.

    python tests/support/hostile_client.py URL MODE COUNT [--source-ip IP] [--path P] [--interval S] [--for S]

Opens COUNT connections to URL's host and port (from --source-ip, any 127.x.y.z address on Linux, so that
one test can be several clients), prints `READY` once they are open, and watches each until the server
closes it or --for seconds pass (counted once all are open). Then prints one JSON line: for each
connection, the seconds after the first connect at which the server closed it (null: still open) and the
body bytes it had read. Modes:

    silent     connects and sends nothing
    drip-head  sends a request line, then one header byte per --interval, never ending the head
    slow-read  asks for --path with a 1 KiB receive buffer and never reads the answer
    reset      asks for --path, reads 1 KiB of the answer, then resets the connection (SO_LINGER 0)

Standard library only; the parent ends it by closing its stdin or by its pid.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import struct
import sys
import time
from urllib.parse import urlsplit


def connect(host: str, port: int, source_ip: str | None, small_buffer: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if small_buffer:  # set before connecting, so the window the server sees is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    if source_ip:
        sock.bind((source_ip, 0))
    sock.settimeout(5)
    sock.connect((host, port))
    sock.setblocking(False)
    return sock


_TCP_GONE = {7, 8}  # TCP_CLOSE (reset), TCP_CLOSE_WAIT (the server sent FIN), from linux/tcp_states.h


def closed_by_server(sock: socket.socket, read: bool) -> tuple[bool, int]:
    """Whether the server closed or reset `sock`; reads (and counts) what is waiting only when `read`. Without
    reading, the socket's TCP state says it: data still queued would hide a reset from recv."""
    if not read:
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        return state in _TCP_GONE, 0
    try:
        data = sock.recv(65536)
        return (not data), len(data)
    except BlockingIOError:
        return False, 0
    except OSError:
        return True, 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("mode", choices=["silent", "drip-head", "slow-read", "reset"])
    parser.add_argument("count", type=int)
    parser.add_argument("--source-ip", default=None)
    parser.add_argument("--path", default="/v1/weights/latest")
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--for", dest="duration", type=float, default=10.0)
    args = parser.parse_args()
    parts = urlsplit(args.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = f"GET {args.path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()

    began = time.monotonic()
    socks: list[socket.socket] = []
    for _ in range(args.count):
        sock = connect(host, port, args.source_ip, args.mode == "slow-read")
        if args.mode == "drip-head":
            sock.send(b"GET /v1/weights/latest HTTP/1.1\r\nX-Padding: ")
        elif args.mode in ("slow-read", "reset"):
            sock.send(request)
        socks.append(sock)
    print("READY", flush=True)

    closed_at: list[float | None] = [None] * len(socks)  # seconds after the first connect
    received = [0] * len(socks)
    next_drip = watching_since = time.monotonic()  # --for counts from here: connecting may take a while
    while time.monotonic() - watching_since < args.duration and any(c is None for c in closed_at):
        if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.readline():
            break  # the parent closed our stdin: stop now
        now = time.monotonic()
        for i, sock in enumerate(socks):
            if closed_at[i] is not None:
                continue
            if args.mode == "reset" and received[i] >= 1024:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
                closed_at[i] = -1.0  # we went away, the server did not close it
                continue
            if args.mode == "drip-head" and now >= next_drip:
                try:
                    sock.send(b"a")
                except OSError:
                    closed_at[i] = now - began
                    continue
            gone, n = closed_by_server(sock, read=args.mode in ("silent", "drip-head", "reset"))
            received[i] += n
            if gone:
                closed_at[i] = now - began
        if now >= next_drip:
            next_drip = now + args.interval
        time.sleep(0.02)
    print(json.dumps({"closed_at": closed_at, "received": received}), flush=True)
    for sock in socks:
        try:
            sock.close()
        except OSError:
            pass


if __name__ == "__main__":
    main()
