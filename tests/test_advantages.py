"""Group-relative advantages, online filtering, length targets and the length penalty."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from prime_node.node.environments.length import (
    combined_reward,
    draw_target_length,
    length_penalty,
    thinking_suffix,
)
from prime_node.node.errors import TaskError
from prime_node.trainer.errors import TrainerError
from prime_node.trainer.grpo.advantages import filter_informative, group_advantages


def test_two_right_two_wrong() -> None:
    # mean 0.5, population std 0.5: A = +-0.5 / (0.5 + 1e-6)
    stats = group_advantages([0.0, 1.0, 1.0, 0.0], eps=1e-6)
    assert (stats.mean, stats.std) == (0.5, 0.5)
    assert stats.advantages == pytest.approx(
        [-0.999998000004, 0.999998000004, 0.999998000004, -0.999998000004]
    )
    assert stats.informative


def test_one_right_of_four() -> None:
    # mean 0.25, std sqrt((0.75^2 + 3 * 0.25^2) / 4) = sqrt(3) / 4, so A = sqrt(3), -1/sqrt(3) (eps -> 0)
    stats = group_advantages([1.0, 0.0, 0.0, 0.0], eps=1e-12)
    assert stats.std == pytest.approx(math.sqrt(3) / 4)
    assert stats.advantages == pytest.approx([1.7320508, -0.5773503, -0.5773503, -0.5773503], abs=1e-6)
    assert sum(stats.advantages) == pytest.approx(0.0, abs=1e-12)


def test_equal_rewards_give_exact_zeros() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point; the group must still count as uninformative
    for rewards in ([0.1, 0.1, 0.1], [1.0, 1.0], [0.0] * 16, [-0.37] * 5, [7.0]):
        stats = group_advantages(rewards)
        assert stats.advantages == (0.0,) * len(rewards)
        assert not stats.informative


def test_online_filtering_keeps_only_groups_with_signal() -> None:
    groups = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.3, 0.3, 0.3], [0.5, 0.25, 0.5]]
    kept = filter_informative(groups)
    assert [i for i, _ in kept] == [1, 4]
    assert kept[0][1].advantages == pytest.approx([-1.0, 1.0], abs=1e-5)


def test_bad_rewards_are_refused() -> None:
    with pytest.raises(TrainerError):
        group_advantages([])
    with pytest.raises(TrainerError, match="finite"):
        group_advantages([0.0, float("nan")])


def test_target_length_draw_is_deterministic_and_covers_the_set() -> None:
    choices = [16, 32, 48, 64]
    # pinned: contributor and validator on different machines and Python versions must agree
    assert [draw_target_length(s, choices) for s in range(8)] == [32, 32, 64, 48, 64, 32, 64, 32]
    counts = Counter(draw_target_length(s, choices) for s in range(4000))
    assert set(counts) == set(choices)
    assert all(850 < n < 1150 for n in counts.values())  # uniform within sampling noise (expected 1000)
    with pytest.raises(TaskError):
        draw_target_length(0, [])


def test_suffix_and_penalty() -> None:
    assert thinking_suffix(48) == " Think for 48 tokens before giving the answer."
    assert length_penalty(40, 64, alpha=0.001) == pytest.approx(0.024)
    assert length_penalty(70, 64, alpha=0.001) == pytest.approx(0.006)
    assert combined_reward(1.0, 40, 64, 0.001) == pytest.approx(0.976)
    assert combined_reward(1.0, 40, None, 0.001) == 1.0
    # the penalty separates equally correct samples, so a group of all-correct answers still carries signal
    stats = group_advantages([combined_reward(1.0, n, 32, 0.01) for n in (30, 32, 40)])
    assert stats.informative and stats.advantages[1] == max(stats.advantages)
