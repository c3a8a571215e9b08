"""Difficulty annotation: per task and annotating model, n, correct count, mean reward and pass@k.

pass@k is the unbiased estimator of Chen et al. (2021): from n verified samples of a task of which c are
correct, the probability that k samples drawn without replacement hold at least one correct one,

    pass@k = 1 - C(n - c, k) / C(n, k)

computed as the product 1 - prod_{i = n - c + 1}^{n} (1 - k / i), which never forms the binomials (they
overflow floats from n ~ 1000) and is exact to rounding; 1.0 when n - c < k (every draw of k holds a correct
one), and null when k > n (too few samples to say). pass@1 is c / n, the offline filter's pass rate
(node/environments/difficulty.py), and is written under that name, `pass_rate`, too: an annotation file
opens as `--env filtered:FILE` (one row per task, with its prompt, answer, source and source index) and
`prime-node tasks` tools read its band directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import DatasetError

DEFAULT_KS = (1, 2, 4, 8, 16)
MAX_K = 1024


def pass_at_k(n: int, c: int, k: int) -> float | None:
    """The unbiased pass@k from n samples, c of them correct; None when k > n."""
    if not (0 <= c <= n) or k < 1:
        raise DatasetError(f"pass@k needs 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        return None
    if n - c < k:
        return 1.0
    if k == 1:  # exactly c / n, the pass rate, so that the two columns agree to the bit
        return c / n
    failing = 1.0
    for i in range(n - c + 1, n + 1):
        failing *= 1.0 - k / i
    return 1.0 - failing


def pass_at_k_exact(n: int, c: int, k: int) -> float | None:
    """The same estimator with exact integer binomials (for tests and small n)."""
    if k > n:
        return None
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class Outcome:
    """One verified sample as the annotation reads it."""

    model: str
    task_index: int
    task_reward: float
    correct: bool


@dataclass(frozen=True)
class TaskDifficulty:
    model: str
    task_index: int
    n: int
    correct: int
    mean_reward: float
    pass_at: dict[int, float | None]

    @property
    def pass_rate(self) -> float:
        return self.correct / self.n

    def columns(self, ks: Sequence[int]) -> dict[str, object]:
        return {
            "model": self.model,
            "task_index": self.task_index,
            "n": self.n,
            "correct": self.correct,
            "mean_reward": self.mean_reward,
            "pass_rate": self.pass_rate,
            **{f"pass_at_{k}": self.pass_at[k] for k in ks},
        }


def check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    if not ks or any(not 1 <= k <= MAX_K for k in ks) or len(set(ks)) != len(ks):
        raise DatasetError(f"pass@k: give distinct k in 1..{MAX_K}, got {list(ks)}")
    return tuple(sorted(ks))


def annotate(outcomes: Iterable[Outcome], ks: Sequence[int] = DEFAULT_KS) -> list[TaskDifficulty]:
    """One TaskDifficulty per (model, task) present in `outcomes`, sorted by model then task index."""
    ks = check_ks(ks)
    groups: dict[tuple[str, int], list[Outcome]] = {}
    for o in outcomes:
        if not math.isfinite(o.task_reward):
            raise DatasetError(f"task {o.task_index} of {o.model}: non-finite reward {o.task_reward!r}")
        groups.setdefault((o.model, o.task_index), []).append(o)
    out = []
    for (model, index), group in sorted(groups.items()):
        n = len(group)
        c = sum(1 for o in group if o.correct)
        mean = math.fsum(o.task_reward for o in group) / n
        out.append(TaskDifficulty(model, index, n, c, mean, {k: pass_at_k(n, c, k) for k in ks}))
    return out
