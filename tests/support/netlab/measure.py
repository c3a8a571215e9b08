"""Measurements across the lab: TCP throughput from one host to another, and whether a connection opens.

Both ends are small stdlib Python programs run inside the hosts' namespaces, so what is measured is the
link (caps, NAT, proxies), not the product.
"""

from __future__ import annotations

import json
import sys
import time

from .lab import Host

_RECEIVER = r"""
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); s.settimeout(float(sys.argv[2]))
print("READY", flush=True)
c, _ = s.accept(); c.settimeout(float(sys.argv[2]))
n, first = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    first = first or time.monotonic()
    n += len(b)
end = time.monotonic()
c.sendall(b"k"); c.close()
print(json.dumps({"bytes": n, "seconds": end - (first or end)}), flush=True)
"""

_SENDER = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
block = b"\0" * (1 << 20)
for _ in range(int(sys.argv[3])):
    s.sendall(block)
s.shutdown(socket.SHUT_WR); s.recv(1)
"""

_CONNECT = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("open")
except OSError as exc:
    print(f"closed: {exc}")
"""


def throughput_mbit(
    sender: Host,
    receiver: Host,
    mbytes: int = 16,
    port: int = 5201,
    timeout_s: float = 120.0,
    to_ip: str | None = None,
    connect_port: int | None = None,
) -> float:
    """Mbit/s of payload moved from `sender` to `receiver` over one TCP connection, timed at the receiver
    from its first byte to the sender's end of stream. The receiver listens on `port`; the sender connects
    to `to_ip`:`connect_port` (default: the receiver's own address and `port`; another, e.g. a proxy's)."""
    listener = receiver.start(
        f"iperf-rx-{receiver.name}-{port}", [sys.executable, "-c", _RECEIVER, str(port), str(timeout_s)]
    )
    try:
        deadline = time.monotonic() + 20
        while not (listener.log_path.exists() and "READY" in listener.log_path.read_text()):
            if time.monotonic() > deadline or listener.process.poll() is not None:
                raise RuntimeError(f"the receiver did not start:\n{listener.log_tail()}")
            time.sleep(0.05)
        sent = sender.run(
            [
                sys.executable,
                "-c",
                _SENDER,
                to_ip or receiver.ip,
                str(connect_port or port),
                str(mbytes),
                str(timeout_s),
            ],
            timeout=timeout_s,
        )
        if sent.returncode != 0:
            raise RuntimeError(f"the sender failed: {sent.stderr.strip()[-400:]}")
        listener.process.wait(timeout=30)
        result = json.loads(listener.log_path.read_text().splitlines()[-1])
    finally:
        receiver.lab.processes.stop(listener, grace=2)
    return result["bytes"] * 8 / result["seconds"] / 1e6


def can_connect(client: Host, ip: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether `client` can open a TCP connection to ip:port (a refused or dropped SYN: False)."""
    done = client.run([sys.executable, "-c", _CONNECT, ip, str(port), str(timeout_s)], timeout=timeout_s + 15)
    return done.stdout.startswith("open")
