"""netlab: the internet on one machine, for tests and benchmarks (docs/network.md).

Hosts are Linux network namespaces joined by veth pairs through an "internet" namespace (a bridge);
each host's line can be capped (tc tbf, both directions); home routers NAT the hosts behind them
(iptables MASQUERADE; nothing from outside reaches a NAT'd host); latency, where needed, comes from a
user-space delaying proxy. Real processes (`prime-node` roles) run on the hosts with `ip netns exec`.
Needs root, iproute2 and iptables (scripts/setup.sh installs them); `unavailable_reason()` says why not.

    from support.netlab import Lab, throughput_mbit

    with Lab(tmp_dir) as lab:                      # removes everything it made on exit
        trainer = lab.host("trainer", mbit=50)     # public: reachable at trainer.ip
        home = lab.home("home", mbit=100)          # a NAT router on the internet at home.ip
        node = lab.host("node", mbit=50, behind=home)
        child = node.start("node", ["prime-node", "start", ...], env=...)   # logs in tmp_dir/logs/node.log
        print(throughput_mbit(trainer, node))      # about 48 under a 50 Mbit/s cap

Tests use the `netlab` fixture (a Lab per test; skips with the reason; removes what a crashed test left).
Benchmarks import it the same way, with tests/ on sys.path (benchmarks/link_caps.py).

Layers: commands (running ip/tc/iptables, availability) -> cleanup (names, leftovers) -> lab (topology,
processes) -> measure (throughput, reachability) -> fixture (the pytest fixture).
"""

from .cleanup import FAMILY, remove_leftovers
from .commands import NetlabError, unavailable_reason
from .lab import INTERNET, Home, Host, Lab, cap
from .measure import can_connect, throughput_mbit

__all__ = [
    "FAMILY",
    "INTERNET",
    "Home",
    "Host",
    "Lab",
    "NetlabError",
    "can_connect",
    "cap",
    "remove_leftovers",
    "throughput_mbit",
    "unavailable_reason",
]
