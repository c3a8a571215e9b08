"""Swarm membership over a hivemind DHT: signed, schema-checked, TTL'd records and rollout hand-off.

Layers, bottom-up: records (wire schemas and the signed envelope) -> validator (the hivemind record
validator every participant installs) -> process (the DHT child process) -> reachability (dial-back
self-test) -> slots (who may hold receive slots) -> handoff (rollout files over libp2p streams) -> routing
(which validator owns a batch) -> peer (the DHT process and our replica of its p2p daemon) -> directory
(publishing and reading signed records) -> swarm (the library API: the hand-off added).
"""

from .config import SwarmConfig
from .errors import HandoffBusy, HandoffError, HandoffRefused, HandoffTooSlow, RecordError, SwarmError
from .handoff import Admitted, Receipt, ReceivedRollout, RolloutEnvelope
from .records import (
    Ban,
    Hardware,
    Heartbeat,
    PolicyAnnouncement,
    RolloutAnnouncement,
    RunParameters,
    ValidatorAnnouncement,
)
from .swarm import Swarm

__all__ = [
    "Admitted",
    "Ban",
    "HandoffBusy",
    "HandoffError",
    "HandoffRefused",
    "HandoffTooSlow",
    "Hardware",
    "Heartbeat",
    "PolicyAnnouncement",
    "Receipt",
    "ReceivedRollout",
    "RecordError",
    "RolloutAnnouncement",
    "RolloutEnvelope",
    "RunParameters",
    "Swarm",
    "SwarmConfig",
    "SwarmError",
    "ValidatorAnnouncement",
]
