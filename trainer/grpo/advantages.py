"""Group-relative advantages and online filtering of the INTELLECT-2 recipe.

The trainer recomputes every group statistic itself from the (validator-recomputed) rewards; it never
uses an advantage a contributor wrote.

Advantage (GRPO, DeepSeekMath): A_i = (r_i - mean(r)) / (std(r) + eps) over the G completions of one
prompt, std being the population standard deviation (divide by G). A group whose rewards are all equal
carries no learning signal (every A_i is 0); online filtering (INTELLECT-2 section 3.3, after DAPO's
dynamic sampling) drops it so that every batch is full of informative groups.

The length reward that enters the rewards (INTELLECT-2 section 3.2) is a task rule every role shares: it
lives in node/environments/length.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import TrainerError

# Rewards that differ by less than this (relative to their scale) count as equal: float sums of equal
# rewards do not always reproduce the mean exactly, and a 1e-17 "advantage" must not pass the filter.
_EQUAL_REWARD_TOLERANCE = 1e-9


@dataclass(frozen=True)
class GroupStats:
    """A group's reward statistics and the advantages derived from them."""

    mean: float
    std: float
    advantages: tuple[float, ...]

    @property
    def informative(self) -> bool:
        """False when every advantage is zero: the group would add nothing but noise to the batch."""
        return any(a != 0.0 for a in self.advantages)


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> GroupStats:
    """(r - mean) / (std + eps) within one prompt's group; exact zeros when all rewards are equal."""
    if len(rewards) == 0:
        raise TrainerError("a group needs at least one reward")
    values = [float(r) for r in rewards]
    if not all(math.isfinite(v) for v in values):
        raise TrainerError(f"group rewards must be finite, got {values}")
    if eps <= 0.0:
        raise TrainerError(f"advantage eps must be positive, got {eps}")
    n = len(values)
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n)
    scale = max(1.0, max(abs(v) for v in values))
    if max(values) - min(values) <= _EQUAL_REWARD_TOLERANCE * scale:
        return GroupStats(mean=mean, std=std, advantages=(0.0,) * n)
    return GroupStats(mean=mean, std=std, advantages=tuple((v - mean) / (std + eps) for v in values))


def filter_informative(groups: Sequence[Sequence[float]], eps: float = 1e-6) -> list[tuple[int, GroupStats]]:
    """Online filtering: (index, stats) of the groups whose advantages are not all zero, in order."""
    kept = []
    for i, rewards in enumerate(groups):
        stats = group_advantages(rewards, eps)
        if stats.informative:
            kept.append((i, stats))
    return kept
