"""The held-out split by content (node/environments/split.py) and where it is used: the warm start's training and
evaluation problems, and the offline filter's index selection."""

from __future__ import annotations

import itertools

import pytest

from prime_node.node.environments import ArithmeticConfig, ArithmeticEnvironment
from prime_node.node.environments.split import ContentSplit
from prime_node.node.errors import TaskError
from prime_node.node.models.warmstart import WarmStartConfig, _training_problems, heldout_tasks
from prime_node.trainer.devnet.tasks import TaskFilter

LEVEL_1 = ArithmeticEnvironment(ArithmeticConfig(level_weights=(1, 0, 0, 0, 0)))


def level_1_prompts() -> set[str]:
    return {f"{a}{op}{b}=" for a in range(10) for b in range(10) for op in "+-"}


def test_split_is_a_function_of_the_prompt_with_about_the_asked_share() -> None:
    split = ContentSplit(0.2)
    prompts = sorted(level_1_prompts())
    held = {p for p in prompts if split.is_heldout(p)}
    assert held == {p for p in prompts if ContentSplit(0.2).is_heldout(p)}  # no hidden state
    assert 25 <= len(held) <= 55  # 200 prompts, expected 40 (binomial sd 5.7)
    assert held < {
        p for p in prompts if ContentSplit(0.5).is_heldout(p)
    }  # nested: a larger share adds prompts
    assert not any(ContentSplit(0.0).is_heldout(p) for p in prompts)


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5])
def test_split_refuses_a_share_outside_zero_to_one(fraction: float) -> None:
    with pytest.raises(TaskError, match="held-out fraction"):
        ContentSplit(fraction)


def test_trainable_and_heldout_problems_never_share_a_prompt() -> None:
    split = ContentSplit(0.2)
    trained = {t.prompt for t in itertools.islice(split.trainable(LEVEL_1), 2000)}
    held = split.heldout_from_end(LEVEL_1, 300, scan_limit=5000)
    assert len(held) == 300 and all(split.is_heldout(t.prompt) for t in held)
    assert not trained & {t.prompt for t in held}
    assert trained | {t.prompt for t in held} == level_1_prompts()  # every prompt on one side or the other
    # scanned down from the last index: the first found is the last held-out problem of the set
    last = next(i for i in range(len(LEVEL_1) - 1, -1, -1) if split.is_heldout(LEVEL_1.get(i).prompt))
    assert held[0] == LEVEL_1.get(last)


def test_warm_start_without_a_split_keeps_the_split_by_index() -> None:
    config = WarmStartConfig(steps=3, batch_size=4, eval_size=10)
    family = config.eval_tasks()
    assert heldout_tasks(config) == [family.get(i) for i in range(len(family) - 10, len(family))]
    train = config.train_tasks()
    assert list(_training_problems(config)) == [train.get(i) for i in range(12)]


def test_warm_start_with_a_split_trains_and_evaluates_on_opposite_sides() -> None:
    config = WarmStartConfig(steps=50, batch_size=64, eval_size=400, heldout_fraction=0.2)
    split = ContentSplit(0.2)
    trained = list(itertools.islice(_training_problems(config), config.steps * config.batch_size))
    evaluated = heldout_tasks(config)
    assert len(evaluated) == 400 and all(split.is_heldout(t.prompt) for t in evaluated)
    assert not any(split.is_heldout(t.prompt) for t in trained)
    assert {t.difficulty for t in evaluated} == {1, 2, 3, 4, 5}  # still the evaluation mix


def test_offline_filter_selects_one_side_of_the_split() -> None:
    split = ContentSplit(0.3)
    trainable = TaskFilter(count=300, heldout_fraction=0.3)
    held = TaskFilter(count=300, heldout_fraction=0.3, heldout=True)
    family = ArithmeticEnvironment()
    assert sorted(trainable.selected_indices(family) + held.selected_indices(family)) == list(range(300))
    assert all(split.is_heldout(family.get(i).prompt) for i in held.selected_indices(family))
    assert not any(split.is_heldout(family.get(i).prompt) for i in trainable.selected_indices(family))
    assert TaskFilter(count=5, offset=7).selected_indices(family) == [7, 8, 9, 10, 11]
    small = ArithmeticEnvironment(
        ArithmeticConfig(size=10)
    )  # an environment smaller than the count: all of it
    assert TaskFilter(count=5, offset=7).selected_indices(small) == [7, 8, 9]
    assert "held-out side of a 0.3 content split" in held.describe()
