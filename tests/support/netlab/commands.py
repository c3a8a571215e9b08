"""Running `ip`, `tc` and `iptables`, and telling whether they can be used here at all.

Every command is bounded (a hung `ip netns exec` must not hang a test) and fails with one line naming the
command and what it printed. `unavailable_reason` is what a test skips with.
"""

from __future__ import annotations

import os
import shutil
import subprocess

TOOLS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "iptables": "iptables",
}
COMMAND_TIMEOUT_S = 20.0
FAMILY = "pnl"  # the start of every namespace name the harness makes (cleanup.py)


class NetlabError(RuntimeError):
    """A namespace, link, qdisc or firewall rule could not be made or removed (the message names which)."""


def run(argv: list[str], timeout: float = COMMAND_TIMEOUT_S, check: bool = True) -> str:
    """Run `argv`; its stdout. NetlabError (command, exit status, stderr) when it fails and `check`."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise NetlabError(f"`{' '.join(argv)}` did not finish within {timeout:g} s") from None
    except FileNotFoundError:
        raise NetlabError(
            f"`{argv[0]}` is not installed (apt-get install {TOOLS.get(argv[0], argv[0])})"
        ) from None
    if check and done.returncode != 0:
        raise NetlabError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()[:400]}")
    return done.stdout


def in_ns(ns: str, argv: list[str]) -> list[str]:
    """`argv` run inside network namespace `ns` (ip netns exec execs it: the PID is the command's own)."""
    return ["ip", "netns", "exec", ns, *argv]


_probe_result: str | None | bool = False  # False: not probed yet


def unavailable_reason() -> str | None:
    """Why namespaces with caps and NAT cannot be made here (None: they can). Probed once per process by
    making and removing a namespace with a capped veth and a MASQUERADE rule."""
    global _probe_result
    if _probe_result is not False:
        return _probe_result  # type: ignore[return-value]
    _probe_result = _probe()
    return _probe_result


def _probe() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (run the suite as root, or in a container with CAP_NET_ADMIN)"
    missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})
    if missing:
        return f"missing system packages {missing} (scripts/setup.sh installs them with apt-get)"
    ns = f"{FAMILY}{os.getpid()}x0-probe"  # named as a lab's (cleanup.py), so a crash mid-probe is cleaned up too
    try:
        run(["ip", "netns", "add", ns])
        try:
            run(["ip", "-n", ns, "link", "add", "name", "p0", "type", "veth", "peer", "name", "p1"])
            run(
                in_ns(
                    ns,
                    [
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        "p0",
                        "root",
                        "tbf",
                        "rate",
                        "1mbit",
                        "burst",
                        "64kb",
                        "latency",
                        "100ms",
                    ],
                )
            )
            run(in_ns(ns, ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "p0", "-j", "MASQUERADE"]))
        finally:
            run(["ip", "netns", "del", ns], check=False)
    except NetlabError as exc:
        return f"cannot build a test network here: {exc}"
    return None
