"""The length reward of the INTELLECT-2 recipe (section 3.2, after L1 / LCPO, arXiv 2503.04697).

Each sample gets a target length drawn from a small discrete set, the prompt is suffixed with an
instruction to think for that many tokens, and the reward is task_reward - alpha * |length - target|.
The contributor (which writes the suffix), the validator and the trainer (which recompute the reward) all
derive the target from the sample's seed, so the draw is a pure function of (seed, choices) with no
platform-dependent PRNG. It lives with the tasks because all three sides apply it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ..errors import TaskError

_LENGTH_TARGET_DOMAIN = b"prime-node/length-target/v1"
THINKING_SUFFIX_TEMPLATE = " Think for {target} tokens before giving the answer."


def draw_target_length(seed: int, choices: Sequence[int]) -> int:
    """The target thinking length of the sample with this seed: one of `choices`, uniform, deterministic.

    SHA-256 of (domain, seed) rather than random.Random keeps the draw identical across Python versions
    and independent of any other use of the seed (Gumbel noise, task selection).
    """
    if not choices:
        raise TaskError("length targets are off (empty set of choices); do not draw a target")
    if any(int(c) < 1 for c in choices):
        raise TaskError(f"length targets must be positive token counts, got {list(choices)}")
    if seed < 0 or seed >= 2**64:
        raise TaskError(f"sample seed must fit in 64 unsigned bits, got {seed}")
    digest = hashlib.sha256(_LENGTH_TARGET_DOMAIN + seed.to_bytes(8, "big")).digest()
    return int(choices[int.from_bytes(digest[:8], "big") % len(choices)])


def thinking_suffix(target: int) -> str:
    """The text appended to the prompt asking the model to think for `target` tokens."""
    if target < 1:
        raise TaskError(f"target length must be a positive token count, got {target}")
    return THINKING_SUFFIX_TEMPLATE.format(target=int(target))


def length_penalty(length: int, target: int, alpha: float) -> float:
    """alpha * |length - target|, with length the completion's token count."""
    if length < 0 or target < 1 or alpha < 0.0:
        raise TaskError(f"bad length penalty inputs: length={length}, target={target}, alpha={alpha}")
    return alpha * abs(int(length) - int(target))


def combined_reward(task_reward: float, length: int, target: int | None, alpha: float) -> float:
    """The reward GRPO sees: the task reward minus the length penalty (none when target is None)."""
    if target is None:
        return float(task_reward)
    return float(task_reward) - length_penalty(length, target, alpha)
