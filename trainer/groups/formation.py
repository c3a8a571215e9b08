"""Choosing pipelined groups: a pure, deterministic function of the offers (no clock, no randomness, no I/O).

A group's cost is what bounds its token rate with micro-batching: its slowest stage (stage k of n layers on a
node measured at T layer-tokens/s takes n / T seconds per token) plus the ring's latency (the round trips
between consecutive members, last back to first, which every decode step pays once). A member that is not
directly reachable costs `unreachable_penalty_s` more: its predecessor cannot dial it without a relay.
Unknown round trips cost `unknown_rtt_ms`, so measured, close peers are preferred over guesses.

Groups are formed one after another, each the cheapest that the remaining nodes allow, until no complete
group is left (or `max_groups`). The cheapest group is found exactly when the ordered candidate tuples are
few (`exact_limit`), and by a beam search over stages otherwise; ties go to the smaller node ids, so every
coordinator given the same offers forms the same groups.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...p2p.pipeline.layout import StageLayout
from ...p2p.swarm.group_records import StageAvailability


@dataclass(frozen=True)
class FormationSettings:
    unknown_rtt_ms: float = 250.0  # price of a hop neither end has measured
    unreachable_penalty_s: float = 1.0  # price of a member that is not directly dialable
    exact_limit: int = 20_000  # ordered tuples searched exhaustively; beyond, a beam search
    beam_width: int = 64
    max_groups: int = 64


@dataclass(frozen=True)
class Candidate:
    members: tuple[str, ...]  # node ids in stage order
    cost_s: float


def hop_rtt_ms(offers: Mapping[str, StageAvailability], a: str, b: str, settings: FormationSettings) -> float:
    """The round trip between a and b: the larger of the two sides' measurements (neither can shrink it by
    lying about its own), one side's when only one measured, `unknown_rtt_ms` when neither did."""
    seen = [x for x in (offers[a].rtt_to(b), offers[b].rtt_to(a)) if x is not None]
    return max(seen) if seen else settings.unknown_rtt_ms


def stage_seconds(layout: StageLayout, stage: int, offer: StageAvailability) -> float:
    return len(layout.layer_range(stage)) / offer.layer_tokens_per_s


def group_cost(
    layout: StageLayout,
    members: Sequence[str],
    offers: Mapping[str, StageAvailability],
    settings: FormationSettings,
) -> float:
    slowest = max(stage_seconds(layout, k, offers[m]) for k, m in enumerate(members))
    ring_ms = sum(
        hop_rtt_ms(offers, members[k], members[(k + 1) % len(members)], settings) for k in range(len(members))
    )
    unreachable = sum(not offers[m].reachable for m in members)
    return slowest + ring_ms / 1000.0 + unreachable * settings.unreachable_penalty_s


def _eligible(
    layout: StageLayout, offers: Mapping[str, StageAvailability], pool: Sequence[str]
) -> list[list[str]]:
    return [sorted(m for m in pool if k in offers[m].stages) for k in range(layout.stages)]


def _exact(
    layout: StageLayout,
    offers: Mapping[str, StageAvailability],
    per_stage: list[list[str]],
    settings: FormationSettings,
) -> Candidate | None:
    best: Candidate | None = None
    for members in itertools.product(*per_stage):
        if len(set(members)) != len(members):
            continue
        cost = group_cost(layout, members, offers, settings)
        if best is None or (cost, members) < (best.cost_s, best.members):
            best = Candidate(members, cost)
    return best


def _beam(
    layout: StageLayout,
    offers: Mapping[str, StageAvailability],
    per_stage: list[list[str]],
    settings: FormationSettings,
) -> Candidate | None:
    # Partial groups ranked by their slowest stage plus the open path's latency (the closing hop comes last).
    beam: list[tuple[float, tuple[str, ...]]] = [(0.0, ())]
    for k, eligible in enumerate(per_stage):
        grown: list[tuple[float, tuple[str, ...]]] = []
        for _, members in beam:
            for m in eligible:
                if m in members:
                    continue
                path = members + (m,)
                slowest = max(stage_seconds(layout, i, offers[x]) for i, x in enumerate(path))
                hops = sum(hop_rtt_ms(offers, path[i], path[i + 1], settings) for i in range(k)) / 1000.0
                penalty = sum(not offers[x].reachable for x in path) * settings.unreachable_penalty_s
                grown.append((slowest + hops + penalty, path))
        grown.sort()
        beam = grown[: settings.beam_width]
    finished = [Candidate(m, group_cost(layout, m, offers, settings)) for _, m in beam]
    return min(finished, key=lambda c: (c.cost_s, c.members), default=None)


def cheapest_group(
    layout: StageLayout,
    offers: Mapping[str, StageAvailability],
    pool: Sequence[str],
    settings: FormationSettings,
) -> Candidate | None:
    """The cheapest complete group from `pool` (each member offering its stage), or None if there is none."""
    per_stage = _eligible(layout, offers, pool)
    if any(not eligible for eligible in per_stage):
        return None
    tuples = math.prod(len(e) for e in per_stage)
    search = _exact if tuples <= settings.exact_limit else _beam
    return search(layout, offers, per_stage, settings)


def form_groups(
    layout: StageLayout,
    offers: Mapping[str, StageAvailability],
    settings: FormationSettings | None = None,
) -> list[Candidate]:
    """Disjoint groups, cheapest first, from the nodes whose offers are given (callers pass live ones only)."""
    settings = settings or FormationSettings()
    pool = sorted(offers)
    groups: list[Candidate] = []
    while len(groups) < settings.max_groups:
        found = cheapest_group(layout, offers, pool, settings)
        if found is None:
            break
        groups.append(found)
        pool = [m for m in pool if m not in found.members]
    return groups
