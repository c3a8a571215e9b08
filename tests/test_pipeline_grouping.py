"""Group formation from stage-availability reports: slowest stage plus ring latency, each node once, reachable
nodes preferred, disjoint groups."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from prime_node.node.pipeline.grouping import (
    PeerRtt,
    StageAvailability,
    choose_group,
    form_groups,
    group_cost,
)


def node(
    n: int, stages: list[int], step_ms: float, rtt: dict[int, float] | None = None, reachable: bool = True
):  # type: ignore[no-untyped-def]
    return StageAvailability(
        node_id=f"{n:064x}",
        stages=stages,
        step_ms=step_ms,
        rtts=[PeerRtt(node_id=f"{peer:064x}", ms=ms) for peer, ms in (rtt or {}).items()],
        reachable=reachable,
    )


def ids(group: list[StageAvailability] | None) -> list[int] | None:
    return None if group is None else [int(m.node_id, 16) for m in group]


def test_the_slowest_stage_and_the_ring_latency_decide() -> None:
    nodes = [
        node(1, [0], 10, {2: 2.0}),
        node(2, [1], 10, {1: 2.0}),
        node(3, [1], 5, {1: 400.0}),  # faster, but far from node 1
    ]
    assert ids(choose_group(nodes, 2)) == [1, 2]
    assert group_cost(choose_group(nodes, 2)) == pytest.approx(10 + 1 + 1)


def test_a_node_holds_one_stage_and_missing_stages_give_no_group() -> None:
    both = node(1, [0, 1], 1)
    assert choose_group([both], 2) is None
    assert ids(choose_group([both, node(2, [1], 50)], 2)) == [1, 2]
    assert choose_group([node(1, [0], 1), node(2, [0], 1)], 2) is None


def test_reachable_nodes_are_preferred_over_relayed_ones() -> None:
    rtt = {1: 10.0, 2: 10.0, 3: 10.0}
    nodes = [node(1, [0], 10, rtt), node(2, [1], 10, rtt, reachable=False), node(3, [1], 12, rtt)]
    assert ids(choose_group(nodes, 2)) == [1, 3]


def test_the_search_finds_the_optimum_of_an_exhaustive_enumeration() -> None:
    import random

    rng = random.Random(4)
    nodes = [
        node(
            n,
            sorted(rng.sample(range(3), rng.randrange(1, 4))),
            rng.uniform(5, 50),
            {p: rng.uniform(1, 200) for p in range(7) if p != n and rng.random() < 0.7},
            rng.random() < 0.8,
        )
        for n in range(7)
    ]
    best = min(
        (
            group_cost(list(c))
            for c in itertools.permutations(nodes, 3)
            if all(k in m.stages for k, m in enumerate(c))
        ),
    )
    assert group_cost(choose_group(nodes, 3)) == pytest.approx(best)


def test_disjoint_groups_until_none_is_full() -> None:
    rtt = {n: 5.0 for n in range(10)}
    nodes = [node(n, [n % 2], 10 + n, rtt) for n in range(5)]
    groups = form_groups(nodes, 2)
    assert [ids(g) for g in groups] == [[0, 1], [2, 3]]


def test_a_hostile_report_is_refused() -> None:
    with pytest.raises(ValidationError):
        node(1, [0], float("nan"))
    with pytest.raises(ValidationError):
        node(1, [], 5)
    with pytest.raises(ValidationError):
        node(1, [0], 5, {n: 1.0 for n in range(100)})
