"""Who may hold a validator's receive slots: shares per sender, per network and per tier, and cooldowns.

A receive slot is held while a hand-off's body streams in (p2p/swarm/handoff.py). Slots are few (each one
buffers a file of up to `max_rollout_bytes`), so without shares a handful of slow streams from one peer holds
all of them and honest files wait (issue 18, class 6). A stream may take a slot only if, counting it:

- the slots in use stay within `max_concurrent_handoffs`;
- a newcomer (not established: too little recently accepted work at this validator, as the validator's
  admission decides) leaves `handoff_reserved_slots` free: those are for established nodes only, so no
  number of fresh node ids ever takes them;
- its node id, and separately its libp2p peer id, hold at most `handoff_slots_per_sender` (one peer may
  sign heartbeats for many node ids; one node id could move between peers);
- its network holds at most `handoff_slots_per_network`, whatever mix of established and newcomer ids it
  uses: IPv4 /24, IPv6 /48, from the remote address p2pd reports for the stream (a relayed stream's address
  is its relay's, so every node behind one relay shares that relay's network). So one network never holds
  every slot. Within that share a network's newcomers leave one slot to its established nodes (when the
  share is at least 2), so that newcomer ids on an established node's network cannot use all of it up.

A sender whose body was cut off is cooled down (`Cooldowns`): its next headers are answered "busy" until the
cooldown ends, and each further cut doubles it. A body is cut when it falls below the rate floor, passes its
deadline, or ends (closed or reset) below the floor pro rata (p2p/swarm/framing.py read_at_rate): a stream
that sends nothing and closes just before each window ends pays as one that waits to be cut. A sender at or
above the floor, on a slow link or one that breaks, never pays.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IPV4_PREFIX = 24  # one subscriber, or one hosting customer, usually gets a single /24 at most
IPV6_PREFIX = 48  # a site's usual assignment: a /64 per LAN would give one attacker 65,536 "networks"
UNKNOWN_NETWORK = "unknown"  # no IP in the address: all such streams share one network's share
MAX_TRACKED_SENDERS = 100_000  # cooldown entries kept; the oldest are forgotten first


def network_of(addr: Any, *, group_loopback: bool) -> str | None:
    """The network a stream comes from (the first IP in its remote multiaddr, masked), or None when it is
    the loopback and loopback is not grouped (a devnet runs every node on the validator's own host)."""
    try:
        items = list(addr.items()) if addr is not None else []
    except Exception:  # a multiaddr p2pd sent that our parser cannot walk: counted as unknown, never trusted
        items = []
    for protocol, value in items:
        name = getattr(protocol, "name", "")
        if name not in ("ip4", "ip6") or not isinstance(value, str):
            continue
        try:
            ip = ipaddress.ip_address(value)
        except ValueError:
            return UNKNOWN_NETWORK
        if ip.is_loopback and not group_loopback:
            return None
        prefix = IPV4_PREFIX if ip.version == 4 else IPV6_PREFIX
        return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))
    return UNKNOWN_NETWORK


@dataclass(frozen=True)
class Claim:
    """One stream's claim on a receive slot."""

    node_id: str  # the signed sender
    peer_id: str  # the libp2p peer the stream comes from
    network: str | None  # network_of(); None: not counted per network
    established: bool  # accepted work at this validator: may use the reserved slots


class SlotTable:
    """The receive slots and their shares (module docstring); `acquire` waits, bounded, for a fitting one."""

    def __init__(self, total: int, *, reserved: int, per_sender: int, per_network: int) -> None:
        if not 0 < reserved < total:
            raise ValueError(f"reserved slots ({reserved}) must be at least 1 and below the total ({total})")
        self.total, self.reserved = total, reserved
        self.per_sender, self.per_network = per_sender, per_network
        # ("node"|"peer"|"net"|"net:<tier>"|"tier", key) -> slots held; "net" counts both tiers
        self._held: Counter[tuple[str, str]] = Counter()
        self.in_use = 0
        self._changed = asyncio.Condition()

    def held(self, kind: str, key: str) -> int:
        return self._held[(kind, key)]

    def refusal(self, claim: Claim) -> str | None:
        """Why `claim` may not take a slot now, or None when it may."""
        if self.in_use >= self.total:
            return f"all {self.total} receive slots are taken"
        if not claim.established and self._held[("tier", "newcomer")] >= self.total - self.reserved:
            return f"newcomers hold their {self.total - self.reserved} receive slots (the rest are reserved)"
        if self._held[("node", claim.node_id)] >= self.per_sender:
            return f"this node already holds {self.per_sender} receive slot(s)"
        if self._held[("peer", claim.peer_id)] >= self.per_sender:
            return f"this libp2p peer already holds {self.per_sender} receive slot(s)"
        if claim.network is not None:
            if self._held[("net", claim.network)] >= self.per_network:
                return f"nodes of network {claim.network} hold {self.per_network} receive slot(s)"
            newcomer_share = self.newcomer_share_per_network
            if not claim.established and self._held[("net:newcomer", claim.network)] >= newcomer_share:
                return (
                    f"newcomer nodes of network {claim.network} hold {newcomer_share} receive slot(s) "
                    "(the network's last one is kept for its established nodes)"
                )
        return None

    @property
    def newcomer_share_per_network(self) -> int:
        """Slots one network's newcomers may hold: its share less one kept for its established nodes."""
        return max(1, self.per_network - 1)

    async def acquire(self, claim: Claim, wait_s: float) -> str | None:
        """Take a slot for `claim`, waiting up to `wait_s` for one; None when taken, else why not."""
        deadline = time.monotonic() + wait_s
        async with self._changed:
            while True:
                reason = self.refusal(claim)
                if reason is None:
                    self._count(claim, +1)
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return reason
                try:
                    async with asyncio.timeout(left):
                        await self._changed.wait()
                except TimeoutError:
                    pass  # one last look above

    async def release(self, claim: Claim) -> None:
        async with self._changed:
            self._count(claim, -1)
            self._changed.notify_all()

    def _count(self, claim: Claim, delta: int) -> None:
        tier = "established" if claim.established else "newcomer"
        keys = [("node", claim.node_id), ("peer", claim.peer_id), ("tier", tier)]
        if claim.network is not None:
            keys += [("net", claim.network), (f"net:{tier}", claim.network)]
        for key in keys:
            self._held[key] += delta
            if self._held[key] <= 0:
                del self._held[key]
        self.in_use += delta


@dataclass
class _Strikes:
    count: int
    until: float  # monotonic time the cooldown ends


class Cooldowns:
    """Cut-off senders wait `base_s` x 2^(cuts - 1) (at most `max_s`) before their next hand-off is taken.

    Keyed by node id and by peer id, so neither a fresh node id on the same peer nor the same node id on a
    fresh peer escapes it. A hand-off that completes clears the sender's count (its cooldown was served).
    """

    def __init__(self, base_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s, self.max_s = base_s, max_s
        self._clock = clock
        self._entries: OrderedDict[str, _Strikes] = OrderedDict()

    def remaining(self, node_id: str, peer_id: str) -> float:
        """Seconds until this sender may hand off again (0 when it may now)."""
        now = self._clock()
        ends = [e.until for k in (f"node:{node_id}", f"peer:{peer_id}") if (e := self._entries.get(k))]
        return max([0.0, *(end - now for end in ends)])

    def strike(self, node_id: str, peer_id: str) -> float:
        """Record a cut; returns the cooldown it earned."""
        now = self._clock()
        count = 1 + max(
            (
                e.count
                for k in (f"node:{node_id}", f"peer:{peer_id}")
                if (e := self._entries.get(k)) is not None
            ),
            default=0,
        )
        cooldown = min(self.max_s, self.base_s * 2 ** min(count - 1, 32))
        for key in (f"node:{node_id}", f"peer:{peer_id}"):
            self._entries.pop(key, None)
            self._entries[key] = _Strikes(count, now + cooldown)  # most recent last
        while len(self._entries) > MAX_TRACKED_SENDERS:
            self._entries.popitem(last=False)
        return cooldown

    def completed(self, node_id: str, peer_id: str) -> None:
        for key in (f"node:{node_id}", f"peer:{peer_id}"):
            self._entries.pop(key, None)
