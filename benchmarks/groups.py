"""Group formation benchmark: how good and how costly trainer/groups/formation.py is, in one run.

For random swarms (seeded: throughputs spread 50x, round trips 1-200 ms measured to up to 32 peers each, a
fifth of the nodes not directly reachable, each node offering a random subset of stages) it prints, per size:
  * the CPU seconds form_groups takes (process CPU time, so the shared machine's load does not count);
  * the mean cost (slowest stage + ring latency + penalties) of the groups it forms against the mean cost of
    as many groups dealt at random from the same nodes (each member offering its stage): the ratio is what
    choosing members buys;
  * the first group's cost against the exhaustive optimum, where that search is small enough to run.

The time from a killed member to the survivors' first verified batch is measured by
tests/test_group_lifecycle.py on a real swarm (run it with -s to see the line it prints).

Usage: .venv/bin/python benchmarks/groups.py [--seed 0] [--sizes 12,60,200] [--stages 4]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.swarm.group_records import PeerRtt, StageAvailability
from prime_node.trainer.groups.formation import FormationSettings, form_groups, group_cost


def swarm(rng: random.Random, n: int, stages: int) -> dict[str, StageAvailability]:
    ids = [f"{rng.getrandbits(256):064x}" for _ in range(n)]
    return {
        i: StageAvailability(
            node_id=i,
            stages=sorted(rng.sample(range(stages), rng.randrange(1, stages + 1))),
            layer_tokens_per_s=rng.uniform(100, 5000),
            rtts=[
                PeerRtt(node_id=p, rtt_ms=rng.uniform(1, 200))
                for p in rng.sample([x for x in ids if x != i], min(32, n - 1))
            ],
            reachable=rng.random() < 0.8,
            published_at=1.0,
        )
        for i in ids
    }


def random_groups(
    rng: random.Random, layout: StageLayout, offers: dict[str, StageAvailability], count: int
) -> list[tuple[str, ...]]:
    pool, groups = list(offers), []
    rng.shuffle(pool)
    while len(groups) < count:
        members: list[str] = []
        for k in range(layout.stages):
            pick = next((m for m in pool if k in offers[m].stages and m not in members), None)
            if pick is None:
                return groups
            members.append(pick)
        pool = [m for m in pool if m not in members]
        groups.append(tuple(members))
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", default="12,60,200")
    parser.add_argument("--stages", type=int, default=4)
    args = parser.parse_args()
    layout = StageLayout(boundaries=list(range(args.stages + 1)))
    settings = FormationSettings()
    print(f"stages={args.stages} seed={args.seed}")
    for n in (int(x) for x in args.sizes.split(",")):
        rng = random.Random(args.seed * 1000 + n)
        offers = swarm(rng, n, args.stages)
        started = time.process_time()
        formed = form_groups(layout, offers, settings)
        cpu = time.process_time() - started
        dealt = random_groups(rng, layout, offers, len(formed))
        ours = statistics.mean(g.cost_s for g in formed) if formed else float("nan")
        theirs = (
            statistics.mean(group_cost(layout, g, offers, settings) for g in dealt) if dealt else float("nan")
        )
        line = (
            f"nodes={n:4d} groups={len(formed):3d} form_cpu_s={cpu:.2f} mean_cost_s formed={ours:.3f} "
            f"random={theirs:.3f} random/formed={theirs / ours:.2f}x"
        )
        if n <= 12:
            tuples = [
                t
                for t in itertools.permutations(offers, args.stages)
                if all(k in offers[m].stages for k, m in enumerate(t))
            ]
            best = min(group_cost(layout, t, offers, settings) for t in tuples)
            line += f" first/optimum={formed[0].cost_s / best:.3f}"
        print(line)


if __name__ == "__main__":
    main()
