#!/usr/bin/env python
"""Does the network-namespace harness give the links it is asked for? Measured rate vs configured cap.

Run as root (tests/support/netlab, docs/network.md): `sudo .venv/bin/python benchmarks/link_caps.py`.
For each cap (--caps, Mbit/s) it builds a lab with a server host (uncapped) and a client host on a capped
line, and moves --mbytes MiB over one TCP connection each way (payload timed at the receiver, from its first
byte to the end of the stream): the client's downlink and uplink. Then the same through a home router
(the client NAT'd, connecting out), and through the delaying proxy (--delay-ms each way), where a single
TCP connection's rate is bounded by its window over the round trip. Prints measured Mbit/s and the ratio to
the cap, all from this one run, after the rate of an uncapped line (the CPU's ceiling for one connection).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.netlab import Lab, can_connect, throughput_mbit, unavailable_reason  # noqa: E402


def _wait_port(host, ip: str, port: int) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 20
    while not can_connect(host, ip, port, timeout_s=1.0):
        if time.monotonic() > deadline:
            raise SystemExit(f"nothing listens on {ip}:{port}")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--caps", type=float, nargs="+", default=[10, 50, 100])
    parser.add_argument("--mbytes", type=int, default=16, help="MiB moved per measurement")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay of the proxy case")
    parser.add_argument("--uncapped-mbytes", type=int, default=256, help="MiB moved over an uncapped line")
    args = parser.parse_args()
    why = unavailable_reason()
    if why is not None:
        raise SystemExit(f"link_caps: {why}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="link-caps-") as tmp, Lab(Path(tmp)) as lab:
        server = lab.host("server")
        home = lab.home("home")
        port = 5300
        # The ceiling without caps: what two cores move through veths and a bridge (Python at both ends).
        free = lab.host("free")
        uncapped = throughput_mbit(server, free, mbytes=args.uncapped_mbytes, port=port)
        for cap in args.caps:
            client = lab.host(f"c{cap:g}", mbit=cap)
            natted = lab.host(f"n{cap:g}", mbit=cap, behind=home)
            paths = (
                ("downlink", server, client),
                ("uplink", client, server),
                ("NAT'd uplink", natted, server),
            )
            for what, src, dst in paths:
                port += 1
                rate = throughput_mbit(src, dst, mbytes=args.mbytes, port=port)
                rows.append((cap, what, rate))
            port += 1
            delayed = _through_proxy(lab, client, server, port, args.delay_ms, args.mbytes)
            rows.append((cap, f"uplink via +{2 * args.delay_ms:g} ms RTT proxy", delayed))
    print(f"uncapped line: {uncapped:.0f} Mbit/s ({args.uncapped_mbytes} MiB over one TCP connection)")
    print(f"{'cap Mbit/s':>10}  {'path':<32} {'measured Mbit/s':>15}  {'ratio':>6}")
    for cap, what, rate in rows:
        print(f"{cap:>10g}  {what:<32} {rate:>15.1f}  {rate / cap:>6.2f}")


def _through_proxy(lab: Lab, client, server, port: int, delay_ms: float, mbytes: int) -> float:  # type: ignore[no-untyped-def]
    proxy_port = port + 1000
    lab.delay(server, proxy_port, ("127.0.0.1", port), delay_ms)
    _wait_port(client, server.ip, proxy_port)
    # The receiver listens on `port`; the sender connects to the proxy in front of it.
    return throughput_mbit(client, server, mbytes=mbytes, port=port, connect_port=proxy_port)


if __name__ == "__main__":
    main()
