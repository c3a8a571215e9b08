"""Which checkpoint the rollout loop may use: the asynchronous window of the INTELLECT-2 recipe.

The trainer accepts rollouts from policies at most `async_level` steps behind the newest announced step,
so generating with anything older wastes the contributor's work. The rule: use the newest locally verified
checkpoint whose step is >= announced - async_level; if none qualifies, wait for a download.
"""

from __future__ import annotations

from collections.abc import Iterable


def usable_step(announced_step: int | None, verified_steps: Iterable[int], async_level: int) -> int | None:
    """The step to generate with, or None to wait. Steps newer than the announcement are not trusted yet."""
    if announced_step is None:
        return None
    floor = announced_step - async_level
    candidates = [s for s in verified_steps if floor <= s <= announced_step]
    return max(candidates) if candidates else None


def steps_to_delete(verified_steps: Iterable[int], announced_step: int | None, async_level: int) -> list[int]:
    """Checkpoints that fell out of the window and can never be used again."""
    if announced_step is None:
        return []
    return sorted(s for s in verified_steps if s < announced_step - async_level)
