"""Difficulty annotation, checked by hand: pass@k (the unbiased estimator), n, correct counts, mean reward,
and the SFT and preference subsets that read them."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from prime_node.trainer.dataset.difficulty import Outcome, annotate, pass_at_k, pass_at_k_exact
from prime_node.trainer.dataset.errors import DatasetError
from prime_node.trainer.dataset.subsets import SftBands, preference_pairs, sft_rows


def test_pass_at_k_by_hand() -> None:
    # n = 5 samples, c = 2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10;
    # pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10; pass@4: every 4 of 5 holds a correct one; pass@6: undefined.
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9, abs=1e-15)
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 2, 5) == 1.0
    assert pass_at_k(5, 2, 6) is None
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    with pytest.raises(DatasetError, match="0 <= c <= n"):
        pass_at_k(3, 4, 1)


def test_pass_at_k_equals_the_exact_binomials() -> None:
    for n, c, k in itertools.product(range(1, 13), range(0, 13), range(1, 13)):
        if c > n:
            continue
        exact = None if k > n else 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        got = pass_at_k(n, c, k)
        assert (got is None) == (exact is None)
        if exact is not None:
            assert got == pytest.approx(float(exact), abs=1e-12), (n, c, k)
            assert pass_at_k_exact(n, c, k) == pytest.approx(float(exact), abs=1e-12)


def test_pass_at_k_stays_finite_where_the_binomials_overflow_floats() -> None:
    # C(2000, 1000) ~ 2e600 overflows a float; the product form does not. With one correct sample in 2000,
    # 1000 draws hold it with probability exactly 1000/2000.
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)
    exact = 1 - Fraction(math.comb(1990, 100), math.comb(2000, 100))
    assert pass_at_k(2000, 10, 100) == pytest.approx(float(exact), rel=1e-12)


def test_annotation_from_raw_outcomes() -> None:
    raw = [
        # task 7 for the generating model: rewards 1, 0, 1, 0, 0.5 (0.5 is not correct: threshold 1.0)
        *(Outcome("teacher", 7, r, r >= 1.0) for r in (1.0, 0.0, 1.0, 0.0, 0.5)),
        # task 7 for a smaller annotating model: 0 of 3
        *(Outcome("small", 7, 0.0, False) for _ in range(3)),
        # task 2 for the teacher: 4 of 4
        *(Outcome("teacher", 2, 1.0, True) for _ in range(4)),
    ]
    got = {(d.model, d.task_index): d for d in annotate(raw, ks=(1, 2, 4))}
    t7 = got["teacher", 7]
    assert (t7.n, t7.correct, t7.mean_reward, t7.pass_rate) == (5, 2, pytest.approx(0.5), pytest.approx(0.4))
    assert t7.pass_at == {1: pytest.approx(0.4), 2: pytest.approx(0.7), 4: 1.0}
    s7 = got["small", 7]
    assert (s7.n, s7.correct, s7.mean_reward) == (3, 0, 0.0)
    assert s7.pass_at == {1: 0.0, 2: 0.0, 4: None}  # 4 > 3 samples: unknown, not 0
    t2 = got["teacher", 2]
    assert t2.pass_at == {1: 1.0, 2: 1.0, 4: 1.0}
    assert list(got) == [("small", 7), ("teacher", 2), ("teacher", 7)]
    columns = t7.columns((1, 2, 4))
    assert columns["pass_rate"] == columns["pass_at_1"] == pytest.approx(0.4)
    with pytest.raises(DatasetError, match="non-finite"):
        annotate([Outcome("m", 1, math.nan, False)])


def _row(sample: str, task: int, correct: bool, tokens: int, prompt: tuple[int, ...] = (1, 2)) -> dict:
    return {
        "sample_id": sample,
        "task_index": task,
        "model": "teacher",
        "correct": correct,
        "task_reward": 1.0 if correct else 0.0,
        "completion_tokens": tokens,
        "prompt": f"task {task}",
        "prompt_ids": list(prompt),
        "completion": sample,
        "completion_ids": [tokens],
    }


def test_sft_bands_and_preference_pairs() -> None:
    rows = [
        _row("a", 1, True, 5),
        _row("b", 1, False, 5),
        _row("c", 1, False, 9),
        _row("d", 2, True, 30),
        _row("e", 3, True, 6),
        _row("f", 3, True, 7),
    ]
    rates = {1: 1 / 3, 2: 1.0, 3: 1.0}
    assert [r["sample_id"] for r in sft_rows(rows, SftBands(), rates)] == ["a", "d", "e", "f"]
    assert [r["sample_id"] for r in sft_rows(rows, SftBands(max_tokens=10), rates)] == ["a", "e", "f"]
    band = SftBands(min_solve_rate=0.125, max_solve_rate=0.5)
    assert [r["sample_id"] for r in sft_rows(rows, band, rates)] == ["a"]
    assert sft_rows(rows, band, {}) == []  # unknown difficulty is outside every band
    pairs = preference_pairs(rows)
    assert [(p["chosen_sample_id"], p["rejected_sample_id"]) for p in pairs] == [("a", "b")]
    with pytest.raises(ValueError, match="min_tokens"):
        SftBands(min_tokens=10, max_tokens=5)
