"""Choosing a group's members from what pipeline-capable nodes report about themselves.

A group's speed is set by its slowest stage and by the ring's latency (every decode step goes once around
the ring: stage 0 -> ... -> last -> stage 0). `choose_group` picks one node per stage, each node at most once,
minimising slowest step time + one-way ring latency, preferring directly reachable nodes (a relayed hop
costs `relay_penalty_ms`); `form_groups` takes disjoint groups until no full group is left.

The availability record is the wire type a node would publish (signed, under the run's DHT key); publishing
it, the operator-signed group record and heartbeat confirmation are not built yet (docs/pipeline.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated

from pydantic import Field, ValidationError

from ...p2p.pipeline.layout import MAX_STAGES
from ...p2p.wire import NodeId, WireFormatError, WireModel, describe, loads_strict
from .errors import PipelineError

MAX_PEERS_MEASURED = 64
MAX_REPORT_BYTES = 16 << 10
UNKNOWN_RTT_MS = 500.0  # a pair that never measured each other: assume a long intercontinental hop
CANDIDATES_PER_STAGE = 8  # fastest nodes considered per stage (the search is exhaustive within them)


class PeerRtt(WireModel):
    node_id: NodeId  # the peer measured
    ms: float = Field(ge=0, le=600_000)  # round-trip time to it


class StageAvailability(WireModel):
    """What a pipeline-capable node reports: the stages it can hold and how fast it is."""

    node_id: NodeId
    stages: list[Annotated[int, Field(ge=0, lt=MAX_STAGES)]] = Field(min_length=1, max_length=MAX_STAGES)
    step_ms: float = Field(gt=0, le=600_000)  # measured time of one decode step of one stage, batch included
    rtts: list[PeerRtt] = Field(max_length=MAX_PEERS_MEASURED)  # round trips it measured to peers it knows
    reachable: bool  # directly dialable (not behind NAT without a relay)

    def rtt_to(self, node_id: str) -> float | None:
        return next((p.ms for p in self.rtts if p.node_id == node_id), None)


def parse_availability(raw: bytes) -> StageAvailability:
    """A node's report as a peer sends it: strict JSON, bounded, every field checked (PipelineError naming it).
    The signed DHT envelope that would carry it (and check its signer first) is not built yet."""
    if len(raw) > MAX_REPORT_BYTES:
        raise PipelineError(f"availability report is {len(raw)} bytes; at most {MAX_REPORT_BYTES}")
    try:
        return StageAvailability.model_validate(loads_strict(raw, "availability report"))
    except WireFormatError as exc:
        raise PipelineError(f"availability report is not strict JSON: {exc}") from None
    except ValidationError as exc:
        raise PipelineError(f"availability report is malformed {describe(exc)}") from None


def _one_way_ms(a: StageAvailability, b: StageAvailability, relay_penalty_ms: float) -> float:
    """Half the round trip either side measured (the smaller: a peer cannot inflate a pair's latency by lying,
    though it can understate its own; reports are self-declared until the group's operator measures them),
    plus a relay penalty when the receiver cannot be dialled."""
    measured = [x for x in (a.rtt_to(b.node_id), b.rtt_to(a.node_id)) if x is not None]
    rtt = min(measured) if measured else UNKNOWN_RTT_MS
    return rtt / 2 + (0.0 if b.reachable else relay_penalty_ms)


def group_cost(members: Sequence[StageAvailability], relay_penalty_ms: float = 50.0) -> float:
    """Slowest stage's step time + one-way latency around the ring (ms per decode step)."""
    ring = sum(
        _one_way_ms(members[k], members[(k + 1) % len(members)], relay_penalty_ms)
        for k in range(len(members))
    )
    return max(m.step_ms for m in members) + ring


def choose_group(
    nodes: Sequence[StageAvailability], stages: int, *, relay_penalty_ms: float = 50.0
) -> list[StageAvailability] | None:
    """The cheapest group (members in stage order), or None when some stage has no candidate left."""
    candidates = [
        sorted((n for n in nodes if k in n.stages), key=lambda n: (n.step_ms, n.node_id))[
            :CANDIDATES_PER_STAGE
        ]
        for k in range(stages)
    ]
    if any(not c for c in candidates):
        return None
    best: list[StageAvailability] | None = None
    best_cost = math.inf

    def extend(chosen: list[StageAvailability], used: set[str]) -> None:
        nonlocal best, best_cost
        k = len(chosen)
        if k == stages:
            cost = group_cost(chosen, relay_penalty_ms)
            if cost < best_cost:
                best, best_cost = list(chosen), cost
            return
        # Lower bound of any completion: the slowest step so far plus the hops already fixed.
        fixed = sum(_one_way_ms(chosen[i], chosen[i + 1], relay_penalty_ms) for i in range(k - 1))
        for node in candidates[k]:
            if node.node_id in used:
                continue
            if max([m.step_ms for m in chosen] + [node.step_ms]) + fixed >= best_cost:
                continue
            chosen.append(node)
            used.add(node.node_id)
            extend(chosen, used)
            chosen.pop()
            used.discard(node.node_id)

    extend([], set())
    return best


def form_groups(
    nodes: Sequence[StageAvailability], stages: int, *, relay_penalty_ms: float = 50.0
) -> list[list[StageAvailability]]:
    """Disjoint groups, cheapest first, until no full group can be formed from the nodes left."""
    left, groups = list(nodes), []
    while (chosen := choose_group(left, stages, relay_penalty_ms=relay_penalty_ms)) is not None:
        groups.append(chosen)
        taken = {m.node_id for m in chosen}
        left = [n for n in left if n.node_id not in taken]
    return groups
