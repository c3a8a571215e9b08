"""Settings of the swarm layer: a plain pydantic model that the CLI layer loads (flags > env > TOML)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..names import RUN_ID_PATTERN
from ..wire import is_hex64
from .kinds import MAX_TTL_S, RecordKind


def _check_maddr(text: str) -> str:
    # Parsed with hivemind's multiaddr so that a typo fails at start-up, not at the first dial.
    from hivemind.utils.multiaddr import Multiaddr

    try:
        Multiaddr(text)
    except Exception as exc:  # the multiaddr library raises several unrelated exception types
        raise ValueError(
            f"{text!r} is not a multiaddr ({exc}); e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3Koo..."
        ) from None
    return text


class SwarmConfig(BaseModel):
    """How this node joins the run's DHT, what it announces, and the limits it enforces on peers."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    run_id: str = Field(
        "prime-node-dev",
        pattern=RUN_ID_PATTERN,
        description="Run id; every DHT key is prefixed with it, so two runs never read each other's records. "
        "The commands take the run's id (run.run_id) unless it is set, as contributors always do.",
    )
    operator_keys: list[str] = Field(
        default_factory=list,
        max_length=8,
        description="Pinned operator public keys (hex): only they sign policy, validator and ban records. A "
        "validator with none pins its own key.",
    )
    initial_peers: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Multiaddrs of peers to bootstrap from (/ip4/.../tcp/.../p2p/...); empty: a new swarm.",
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        min_length=1,
        max_length=8,
        description="Multiaddrs the libp2p daemon listens on (use a fixed port to forward it through a NAT).",
    )
    announce_maddrs: list[str] = Field(
        default_factory=list,
        max_length=8,
        description="Multiaddrs announced instead of the listen ones (public IP and forwarded port).",
    )
    reachability: Literal["auto", "public", "private"] = Field(
        "auto",
        description="auto: a bootstrap peer dials us back to decide; public: full DHT peer; private: client "
        "(docs/swarm.md).",
    )
    reachability_timeout_s: float = Field(
        3.0,
        gt=0,
        le=60,
        description="How long a dial-back probe may take before the node counts as unreachable.",
    )
    wait_timeout_s: float = Field(
        3.0, gt=0, le=60, description="Timeout of one DHT RPC (hivemind wait_timeout)."
    )
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        le=600,
        description="Limit for one get/store through the DHT process (a full lookup or store).",
    )
    startup_timeout_s: float = Field(30.0, gt=0, le=600, description="Limit for starting the DHT process.")
    beam_size: int = Field(
        8,
        ge=5,
        le=64,
        description="Nearest peers a DHT search (get or store) keeps asking per key (hivemind's default is "
        "20): a read merges the table from each, so fewer ask less; at least the 5 that store each record.",
    )
    shutdown_timeout_s: float = Field(
        5.0, gt=0, le=60, description="Grace period of the DHT process at leave."
    )
    heartbeat_interval_s: float = Field(
        15.0, gt=0, le=300, description="How often this node republishes its heartbeat."
    )
    heartbeat_ttl_s: float = Field(
        60.0,
        gt=0,
        le=MAX_TTL_S[RecordKind.HEARTBEAT],
        description="Lifetime of a heartbeat; a node silent for longer disappears from the peer list.",
    )
    record_ttl_s: float = Field(
        600.0,
        gt=0,
        le=MAX_TTL_S[RecordKind.POLICY],
        description="Lifetime of policy, validator and rollout announcements published by this node.",
    )
    ban_ttl_s: float = Field(
        86400.0,
        gt=0,
        le=MAX_TTL_S[RecordKind.BAN],
        description="Lifetime of a ban record (republish to extend).",
    )
    policy_poll_s: float = Field(2.0, gt=0, le=300, description="How often watch_policy polls the DHT.")
    max_rollout_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, le=1 << 31, description="Largest rollout file a validator accepts."
    )
    handoff_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="Limit for one hand-off step (connect, header, body, receipt)."
    )
    max_concurrent_handoffs: int = Field(
        4, ge=2, le=256, description="Hand-offs a validator receives at once; more wait (back-pressure)."
    )
    # What a receive slot costs its holder, and who may hold one (p2p/swarm/slots.py, docs/protocol.md).
    handoff_min_bytes_per_s: int = Field(
        64 * 1024,
        ge=1,
        le=1 << 30,
        description="Rate floor of a hand-off's body: a sender slower than this over a window is cut off.",
    )
    handoff_rate_window_s: float = Field(
        10.0, gt=0, le=600, description="Window over which the rate floor is measured."
    )
    handoff_deadline_grace_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="A body's total deadline is this plus its size at the rate floor.",
    )
    handoff_reserved_slots: int = Field(
        2,
        ge=1,
        le=255,
        description="Receive slots only established nodes (recently accepted work) may use; below the total.",
    )
    handoff_slots_per_sender: int = Field(
        1, ge=1, le=256, description="Receive slots one node id, or one libp2p peer id, may hold at once."
    )
    handoff_slots_per_network: int = Field(
        2,
        ge=1,
        le=256,
        description="Receive slots the nodes of one network (IPv4 /24, IPv6 /48) may hold at once, "
        "established and newcomers together; below the total.",
    )
    handoff_group_loopback: bool = Field(
        False,
        description="Count loopback senders as one network too (off: a devnet runs every node on one host).",
    )
    handoff_slot_wait_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="How long a checked header waits for a receive slot before the sender is told busy.",
    )
    handoff_cooldown_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Cooldown after a sender is cut off for being too slow; doubles with each further cut.",
    )

    @field_validator("operator_keys")
    @classmethod
    def _hex_keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if not is_hex64(key):
                raise ValueError(f"operator key {key[:80]!r} is not 64 lowercase hex digits (a node id)")
        return keys

    @field_validator("initial_peers", "host_maddrs", "announce_maddrs")
    @classmethod
    def _maddrs(cls, values: list[str]) -> list[str]:
        return [_check_maddr(v) for v in values]

    @field_validator("initial_peers")
    @classmethod
    def _peers_name_peer_id(cls, values: list[str]) -> list[str]:
        for value in values:
            if "/p2p/" not in value:
                raise ValueError(
                    f"initial peer {value!r} lacks its /p2p/<peer id> part; copy the full address"
                )
        return values

    @model_validator(mode="after")
    def _newcomers_leave_reserved_slots(self) -> SwarmConfig:
        if self.handoff_reserved_slots >= self.max_concurrent_handoffs:
            raise ValueError(
                f"handoff_reserved_slots ({self.handoff_reserved_slots}) must be below "
                f"max_concurrent_handoffs ({self.max_concurrent_handoffs}): newcomers may use the rest"
            )
        if self.handoff_slots_per_network >= self.max_concurrent_handoffs:
            raise ValueError(
                f"handoff_slots_per_network ({self.handoff_slots_per_network}) must be below "
                f"max_concurrent_handoffs ({self.max_concurrent_handoffs}): one network must never hold every "
                "receive slot"
            )
        return self

    @model_validator(mode="after")
    def _heartbeat_outlives_interval(self) -> SwarmConfig:
        # A heartbeat that expires before the next one is sent makes a live node flicker out of the list.
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}); about 4x is a good ratio"
            )
        return self
