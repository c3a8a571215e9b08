"""Choosing pipelined groups: a pure, deterministic function of the offers (no clock, no randomness, no I/O).

A group's cost is what bounds its token rate with micro-batching: its slowest stage (stage k of n layers on a
node measured at T layer-tokens/s takes n / T seconds per token) plus the ring's latency (the round trips
between consecutive members, last back to first, which every decode step pays once). A member that is not
directly reachable costs `unreachable_penalty_s` more: its predecessor cannot dial it without a relay.
Unknown round trips cost `unknown_rtt_ms`, so measured, close peers are preferred over guesses.

Groups are formed one after another, each the cheapest that the remaining nodes allow, until no complete
group is left (or `max_groups`). The cheapest group is found exactly when the ordered candidate tuples are
few (`exact_limit`), and by a beam search over stages otherwise; ties go to the smaller node ids, so every
coordinator given the same offers forms the same groups. Pairs of nodes kept `apart` (plan.py: a member that gave
a group up for its failed batches and that group's other members) are never put in one group.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence, Set
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


# Two node ids, the smaller first: a pair no group may hold together (`node_pair` makes one).
NodePair = tuple[str, str]


def node_pair(a: str, b: str) -> NodePair:
    return (a, b) if a < b else (b, a)


def _any_apart(members: Sequence[str], newcomer: str, apart: Set[NodePair]) -> bool:
    return bool(apart) and any(node_pair(m, newcomer) in apart for m in members)


@dataclass(frozen=True)
class Candidate:
    members: tuple[str, ...]  # node ids in stage order
    cost_s: float


def group_cost(
    layout: StageLayout,
    members: Sequence[str],
    offers: Mapping[str, StageAvailability],
    settings: FormationSettings,
) -> float:
    return _Prices(layout, offers, settings).cost(members)


class _Prices:
    """group_cost's terms, looked up in tables built once per formation (the search asks for them often)."""

    def __init__(
        self, layout: StageLayout, offers: Mapping[str, StageAvailability], settings: FormationSettings
    ) -> None:
        self.settings = settings
        self.rtt = {(a, r.node_id): r.rtt_ms for a, offer in offers.items() for r in offer.rtts}
        self.seconds = {
            (k, m): len(layout.layer_range(k)) / offer.layer_tokens_per_s
            for m, offer in offers.items()
            for k in offer.stages
            if k < layout.stages
        }
        self.penalty = {m: (not o.reachable) * settings.unreachable_penalty_s for m, o in offers.items()}

    def hop_s(self, a: str, b: str) -> float:
        # The larger of the two sides' measurements (neither end can shrink a hop by lying about its own side),
        # one side's when only one measured, `unknown_rtt_ms` when neither did.
        seen = [x for x in (self.rtt.get((a, b)), self.rtt.get((b, a))) if x is not None]
        return (max(seen) if seen else self.settings.unknown_rtt_ms) / 1000.0

    def path(self, members: Sequence[str]) -> float:
        """Slowest stage + the open path's hops + penalties (a partial group, in stage order from 0)."""
        slowest = max(self.seconds[(k, m)] for k, m in enumerate(members))
        hops = sum(self.hop_s(members[i], members[i + 1]) for i in range(len(members) - 1))
        return slowest + hops + sum(self.penalty[m] for m in members)

    def cost(self, members: Sequence[str]) -> float:
        return self.path(members) + self.hop_s(members[-1], members[0])


def _eligible(
    layout: StageLayout, offers: Mapping[str, StageAvailability], pool: Sequence[str]
) -> list[list[str]]:
    return [sorted(m for m in pool if k in offers[m].stages) for k in range(layout.stages)]


def _exact(per_stage: list[list[str]], prices: _Prices, apart: Set[NodePair]) -> Candidate | None:
    best: Candidate | None = None
    for members in itertools.product(*per_stage):
        if len(set(members)) != len(members):
            continue
        if apart and any(_any_apart(members[:k], m, apart) for k, m in enumerate(members)):
            continue
        cost = prices.cost(members)
        if best is None or (cost, members) < (best.cost_s, best.members):
            best = Candidate(members, cost)
    return best


def _beam(per_stage: list[list[str]], prices: _Prices, width: int, apart: Set[NodePair]) -> Candidate | None:
    # Partial groups ranked by their slowest stage plus the open path's latency (the closing hop comes last).
    beam: list[tuple[float, tuple[str, ...]]] = [(0.0, ())]
    for eligible in per_stage:
        grown = [
            (prices.path(members + (m,)), members + (m,))
            for _, members in beam
            for m in eligible
            if m not in members and not _any_apart(members, m, apart)
        ]
        grown.sort()
        beam = grown[:width]
    finished = [Candidate(m, prices.cost(m)) for _, m in beam]
    return min(finished, key=lambda c: (c.cost_s, c.members), default=None)


def cheapest_group(
    layout: StageLayout,
    offers: Mapping[str, StageAvailability],
    pool: Sequence[str],
    settings: FormationSettings,
    apart: Set[NodePair] = frozenset(),
) -> Candidate | None:
    """The cheapest complete group from `pool` (each member offering its stage, no two of them kept `apart`), or
    None if there is none."""
    per_stage = _eligible(layout, offers, pool)
    if any(not eligible for eligible in per_stage):
        return None
    prices = _Prices(layout, offers, settings)
    if math.prod(len(e) for e in per_stage) <= settings.exact_limit:
        return _exact(per_stage, prices, apart)
    return _beam(per_stage, prices, settings.beam_width, apart)


def form_groups(
    layout: StageLayout,
    offers: Mapping[str, StageAvailability],
    settings: FormationSettings | None = None,
    apart: Set[NodePair] = frozenset(),
) -> list[Candidate]:
    """Disjoint groups, cheapest first, from the nodes whose offers are given (callers pass live ones only), none
    holding a pair kept `apart`."""
    settings = settings or FormationSettings()
    pool = sorted(offers)
    groups: list[Candidate] = []
    while len(groups) < settings.max_groups:
        found = cheapest_group(layout, offers, pool, settings, apart)
        if found is None:
            break
        groups.append(found)
        pool = [m for m in pool if m not in found.members]
    return groups
