"""Swarm membership over a hivemind DHT: signed, schema-checked, TTL'd records and rollout hand-off.

Layers, bottom-up: records (wire schemas and the signed envelope) -> validator (the hivemind record
validator every participant installs) -> process (the DHT child process) -> reachability (dial-back
self-test) -> slots (who may hold receive slots) -> handoff (rollout files over libp2p streams) -> routing
(which validator owns a batch) -> peer (the DHT process and our replica of its p2p daemon) -> directory
(publishing and reading signed records) -> swarm (the library API: the hand-off added).

SwarmConfig and the errors load with the package; the names that need hivemind (and so torch) load when
first used (PEP 562), so that the command line, which builds its flags from SwarmConfig, starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import SwarmConfig
from .errors import HandoffBusy, HandoffError, HandoffRefused, HandoffTooSlow, RecordError, SwarmError

if TYPE_CHECKING:
    from .handoff import Admitted, DeliveryKey, Receipt, ReceivedRollout, RolloutEnvelope
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

# Name -> the module of this package that defines it, for the names loaded on first use.
_LOADED_ON_USE = {
    **dict.fromkeys(["Admitted", "DeliveryKey", "Receipt", "ReceivedRollout", "RolloutEnvelope"], "handoff"),
    **dict.fromkeys(
        [
            "Ban",
            "Hardware",
            "Heartbeat",
            "PolicyAnnouncement",
            "RolloutAnnouncement",
            "RunParameters",
            "ValidatorAnnouncement",
        ],
        "records",
    ),
    "Swarm": "swarm",
}

__all__ = [
    "Admitted",
    "Ban",
    "DeliveryKey",
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


def __getattr__(name: str) -> Any:
    module = _LOADED_ON_USE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
