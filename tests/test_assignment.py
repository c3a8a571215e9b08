"""Deterministic work assignment: reproducible, well spread, and every deviation rejected."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prime_node.proofs.assignment import MAX_SEED, AssignmentError, assign, check_assignment

NODE = "ab" * 32
OTHER = "cd" * 32


def _rows(**kw) -> list[tuple[int, int]]:
    args = dict(
        run_seed=1, node_id=NODE, policy_step=3, batch_counter=0, task_count=1000, prompts=4, samples=2
    )
    args.update(kw)
    return list(
        assign(
            args.pop("run_seed"),
            args.pop("node_id"),
            args.pop("policy_step"),
            args.pop("batch_counter"),
            **args,
        ).rows()
    )


def test_assignment_is_deterministic_across_processes():
    here = _rows()
    code = (
        "from prime_node.proofs.assignment import assign;"
        f"print(list(assign(1, {NODE!r}, 3, 0, task_count=1000, prompts=4, samples=2).rows()))"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert there.strip() == repr(here)


def test_every_input_changes_the_assignment():
    base = _rows()
    for change in ({"run_seed": 2}, {"node_id": OTHER}, {"policy_step": 4}, {"batch_counter": 1}):
        assert _rows(**change) != base, change


def test_indices_distinct_in_range_and_seeds_valid():
    a = assign(0, NODE, 0, 0, task_count=50, prompts=50, samples=3)
    assert sorted(a.sample_indices) == list(range(50))  # all of a small set, each once
    seeds = [s for group in a.sample_seeds for s in group]
    assert len(set(seeds)) == len(seeds) and all(0 <= s <= MAX_SEED for s in seeds)
    # more prompts keep the earlier ones: the stream is a prefix
    assert (
        assign(0, NODE, 0, 0, task_count=10**6, prompts=8, samples=2).sample_indices[:4]
        == assign(0, NODE, 0, 0, task_count=10**6, prompts=4, samples=2).sample_indices
    )


def test_indices_are_spread_uniformly():
    counts = [0] * 10
    for counter in range(300):
        for index in assign(5, NODE, 0, counter, task_count=10, prompts=1, samples=1).sample_indices:
            counts[index] += 1
    assert min(counts) > 15 and max(counts) < 50


def test_check_accepts_the_assignment_and_rejects_deviations():
    rows = _rows()
    check = dict(run_seed=1, node_id=NODE, policy_step=3, batch_counter=0, task_count=1000, samples=2)
    check_assignment(rows, **check)
    check_assignment(rows[:4], **check)  # fewer prompts, each with all its samples
    with pytest.raises(AssignmentError, match="row 2: sample index"):
        check_assignment(rows[:2] + [(rows[2][0] + 1, rows[2][1])] + rows[3:], **check)
    with pytest.raises(AssignmentError, match="row 1: sample seed"):
        check_assignment([rows[0], (rows[1][0], rows[1][1] ^ 1)] + rows[2:], **check)
    with pytest.raises(AssignmentError, match="row 0: sample index"):
        check_assignment(rows[2:] + rows[:2], **check)  # reordered prompts
    with pytest.raises(AssignmentError, match="multiple of 2"):
        check_assignment(rows[:3], **check)
    with pytest.raises(AssignmentError, match="expected 8 prompts"):
        check_assignment(rows, **check, prompts=8)
    with pytest.raises(AssignmentError, match="sample index"):
        check_assignment(rows, **{**check, "node_id": OTHER})
    with pytest.raises(AssignmentError, match="sample index"):
        check_assignment(rows, **{**check, "batch_counter": 1})


def test_bad_parameters_are_refused():
    with pytest.raises(AssignmentError, match="distinct prompts"):
        assign(0, NODE, 0, 0, task_count=3, prompts=4, samples=1)
    with pytest.raises(AssignmentError, match="node id must be hex"):
        assign(0, "not-hex", 0, 0, task_count=3, prompts=1, samples=1)
    with pytest.raises(AssignmentError, match="policy step"):
        assign(0, NODE, -1, 0, task_count=3, prompts=1, samples=1)
