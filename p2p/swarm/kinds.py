"""The kinds of swarm record and the longest life an honest peer grants each (records.py enforces it).

Apart from records.py, which needs hivemind, so that SwarmConfig (config.py bounds its TTL settings by these)
loads without hivemind and torch: the command line builds its flags from it.
"""

from __future__ import annotations

from enum import Enum


class RecordKind(str, Enum):
    HEARTBEAT = "heartbeat"
    POLICY = "policy"
    VALIDATOR = "validator"
    BAN = "ban"
    ROLLOUT = "rollout"
    STAGES = "stages"  # a pipeline-capable node's stage availability (group_records.py)
    GROUP = "group"  # an operator-signed pipelined group (group_records.py)


# Longest lifetime an honest peer accepts per kind (plus records.CLOCK_SKEW_S): longer ones are refused.
MAX_TTL_S: dict[RecordKind, float] = {
    RecordKind.HEARTBEAT: 300.0,
    RecordKind.POLICY: 3600.0,
    RecordKind.VALIDATOR: 3600.0,
    RecordKind.BAN: 7 * 86400.0,
    RecordKind.ROLLOUT: 3600.0,
    RecordKind.STAGES: 300.0,
    RecordKind.GROUP: 3600.0,
}
