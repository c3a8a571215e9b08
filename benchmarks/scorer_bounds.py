"""The worst case of a crafted completion against the scorer bound, with honest scores beside it, in one run.

Usage: .venv/bin/python benchmarks/scorer_bounds.py [--repeat N] [--only ENV ...]

Every completion is scored the way nodes and validators score it: by the bounded scorer
(node/environments/scoring.py) under the environment's own limits (`env.scoring`: 5 s wall clock, 5 s CPU
time, an address-space cap), each environment first loaded into the worker by an honest score that is not
timed. The figure per completion is the wall-clock time of the whole `score` call as the caller sees it
(pipe round trip, and for a cut the kill and the start of the replacement worker included), the worst of
`--repeat` runs. The attacks (tests/support/scorer_attacks.py) ran for seconds to minutes in the calling
process before the bounded scorer; here each must end by the bound plus the kill and score 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prime_node.node.environments.environment import Environment
from prime_node.node.environments.math import open_math
from prime_node.node.environments.reasoning_gym import open_reasoning_gym
from prime_node.node.environments.scoring import BoundedScorer
from prime_node.node.environments.types import Task

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.scorer_attacks import MATH_ATTACKS, REASONING_GYM_ATTACKS  # noqa: E402

MATH_ROWS = [
    {"problem": "What is 1/2 + 1/4?", "answer": r"\frac{3}{4}"},
    {"problem": "Expand (x+1)^2.", "answer": "x^2+2x+1"},
    {"problem": "What is sqrt(8)?", "answer": r"2\sqrt{2}"},
    {"problem": "Solve 2x = 7.", "answer": "3.5"},
]
RG_FAMILIES = ("simple_integration", "intermediate_integration", "spell_backward", "chain_sum")
HONEST_MATH = [r"The answer is \boxed{0.75}", r"\boxed{(x+1)^2}", r"$\sqrt{8}$", r"x = \frac{7}{2}"]


@dataclasses.dataclass
class Row:
    env: str
    completion: str
    seconds: float  # the worst of the runs
    score: float
    cut: str  # the limit or fault that ended it; "" when it finished within the limits

    @property
    def honest(self) -> bool:
        return self.completion.startswith("honest")


def _timed(scorer: BoundedScorer, env: Environment, completion: str, task: Task) -> tuple[float, float]:
    started = time.perf_counter()
    value = scorer.score(env, completion, task)
    return time.perf_counter() - started, value


def _measure(
    name: str, env: Environment, honest: list[tuple[str, Task]], attacks: dict[str, str], repeat: int
) -> list[Row]:
    rows: list[Row] = []
    with BoundedScorer(env.scoring) as scorer:
        scorer.score(env, honest[0][0], honest[0][1])  # loads the environment into the worker
        for i, (completion, task) in enumerate(honest):
            runs = [_timed(scorer, env, completion, task) for _ in range(repeat)]
            rows.append(Row(name, f"honest {i}", max(r[0] for r in runs), runs[0][1], ""))
        task = honest[0][1]
        for attack, completion in attacks.items():
            worst, value, cut = 0.0, 0.0, ""
            for _ in range(repeat):
                before = sum(scorer.breaches.values())
                seconds, value = _timed(scorer, env, completion, task)
                worst = max(worst, seconds)
                if sum(scorer.breaches.values()) > before:
                    cut = scorer.last_breach or "?"
                scorer.score(env, honest[0][0], honest[0][1])  # the replacement worker loads, untimed
            rows.append(Row(name, attack, worst, value, cut))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="Runs per completion; the worst is shown.")
    parser.add_argument("--only", nargs="*", default=None, help="Environment names to run (default: all).")
    args = parser.parse_args()
    rows: list[Row] = []
    wall = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "math.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in MATH_ROWS))
        specs = ["math", *(f"reasoning_gym:family={f}" for f in RG_FAMILIES)]
        for name in specs:
            if args.only and name not in args.only:
                continue
            env: Environment
            if name == "math":
                env = open_math(f"path={path}")
                honest = [(c, env.get(i)) for i, c in enumerate(HONEST_MATH)]
                attacks = MATH_ATTACKS
            else:
                env = open_reasoning_gym(name.partition(":")[2], seed=1)
                honest = [(env.get(i).answer, env.get(i)) for i in range(4)]
                attacks = REASONING_GYM_ATTACKS
            limits = env.scoring
            wall = max(wall, limits.wall_s)
            print(f"# {name}: wall {limits.wall_s} s, CPU {limits.cpu_s} s, memory {limits.memory_mb} MiB")
            for row in _measure(name, env, honest, attacks, args.repeat):
                rows.append(row)
                cut = f"cut: {row.cut}" if row.cut else ""
                print(
                    f"  {row.completion:<18} {row.seconds:7.3f} s  score {row.score:.2f}  {cut}", flush=True
                )
    attacks_rows = [r for r in rows if not r.honest]
    honest_rows = [r for r in rows if r.honest]
    worst = max(attacks_rows, key=lambda r: r.seconds)
    honest_worst = max(r.seconds for r in honest_rows)
    print()
    print(
        f"attacks: {len(attacks_rows)}, cut at a limit: {sum(1 for r in attacks_rows if r.cut)}, "
        f"scored above 0: {sum(1 for r in attacks_rows if r.score > 0)}"
    )
    print(
        f"worst attack: {worst.env} {worst.completion}: {worst.seconds:.2f} s = "
        f"{worst.seconds / wall:.2f} x the {wall:g} s bound"
    )
    print(
        f"honest scores: median {statistics.median(r.seconds for r in honest_rows) * 1000:.1f} ms, worst "
        f"{honest_worst * 1000:.1f} ms = 1/{wall / honest_worst:.0f} of the bound"
    )


if __name__ == "__main__":
    main()
