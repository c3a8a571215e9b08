"""The bounded scorer (node/environments/scoring.py) against scorers that hang, allocate without bound, crash
the interpreter or raise: each costs one 0, the worker is replaced, and the next score is honest again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prime_node.node.environments.environment import ScoringLimits
from prime_node.node.environments.scoring import BoundedScorer, ScoringError

from support.hostile_scorer import HostileScorerEnvironment

LIMITS = ScoringLimits(isolation="process", wall_s=2.0, cpu_s=2.0, memory_mb=1024)


def _pid(scorer: BoundedScorer) -> int:
    assert scorer._worker is not None
    return scorer._worker.process.pid


def test_the_worker_warms_an_environment_up_at_load_and_again_after_a_breach() -> None:
    env = HostileScorerEnvironment(LIMITS, warm_up_s=LIMITS.wall_s + 0.5)
    task = env.get(3)
    with BoundedScorer(LIMITS) as scorer:
        assert scorer.score(env, "warmed", task) == 1.0  # warm_up ran at load, outside the 2 s of the score
        assert scorer.score(env, "hang", task) == 0.0
        assert scorer.score(env, "warmed", task) == 1.0  # the replacement worker was warmed up too


def test_each_breach_costs_one_zero_and_a_fresh_worker_then_honest_scores_work() -> None:
    env = HostileScorerEnvironment(LIMITS)
    task = env.get(3)
    with BoundedScorer(LIMITS) as scorer:
        assert scorer.score(env, "3", task) == 1.0  # honest control, before any breach
        assert scorer.score(env, "sleep:0.1", task) == 0.5  # slow but within the limits: its own value
        cases = [
            ("hang", "wall"),
            ("alloc", "memory"),
            ("exit", "crash"),
            ("segfault", "crash"),
            ("raise", "fault"),
            ("nan", "fault"),
        ]
        for completion, kind in cases:
            before = _pid(scorer)
            started = time.monotonic()
            assert scorer.score(env, completion, task) == 0.0, completion
            assert scorer.last_breach == kind, completion
            assert time.monotonic() - started < LIMITS.wall_s + 15, completion
            assert _pid(scorer) != before, f"{completion}: the faulted worker was reused"
            # The next score runs as if nothing had happened: right answers 1, wrong ones 0.
            assert scorer.score(env, "3", task) == 1.0, f"after {completion}"
            assert scorer.score(env, "4", task) == 0.0, f"after {completion}"
        assert scorer.breaches == {"wall": 1, "memory": 1, "crash": 2, "fault": 2}


def test_cpu_time_is_bounded_per_score_even_under_a_long_wall_clock() -> None:
    limits = ScoringLimits(isolation="process", wall_s=120.0, cpu_s=1.0, memory_mb=1024)
    env = HostileScorerEnvironment(limits)
    task = env.get(1)
    with BoundedScorer(limits) as scorer:
        # Honest scores before it spend CPU time too: the budget is per score, not per worker.
        for _ in range(3):
            assert scorer.score(env, "1", task) == 1.0
        started = time.monotonic()
        assert scorer.score(env, "hang", task) == 0.0
        assert scorer.last_breach == "cpu"
        assert time.monotonic() - started < 60
        assert scorer.score(env, "1", task) == 1.0


def test_results_equal_the_scorer_inline_and_repeat_across_workers() -> None:
    env = HostileScorerEnvironment(LIMITS)
    completions = ["0", "1", "2", "x", "sleep:0", "raise", "nan", "exit"]
    runs = []
    for _ in range(2):
        with BoundedScorer(LIMITS) as scorer:
            runs.append([scorer.score(env, c, env.get(i % 3)) for i, c in enumerate(completions)])
    assert runs[0] == runs[1] == [1.0, 1.0, 1.0, 0.0, 0.5, 0.0, 0.0, 0.0]
    inline = BoundedScorer(ScoringLimits(isolation="inline"))
    honest = completions[:5]
    assert [inline.score(env, c, env.get(i % 3)) for i, c in enumerate(honest)] == runs[0][:5]
    assert inline.score(env, "raise", env.get(0)) == 0.0 and inline.last_breach == "fault"


def test_an_environment_that_cannot_load_is_a_configuration_error_not_a_zero() -> None:
    tiny = ScoringLimits(isolation="process", memory_mb=64)  # less than the interpreter and its imports
    env = HostileScorerEnvironment(tiny)
    with BoundedScorer(tiny, start_timeout_s=60) as scorer, pytest.raises(ScoringError, match="64 MiB"):
        scorer.score(env, "1", env.get(1))
    env_unpicklable = HostileScorerEnvironment(LIMITS)
    env_unpicklable.helper = lambda: None  # type: ignore[attr-defined]
    with BoundedScorer(LIMITS) as scorer, pytest.raises(ScoringError, match="cannot be sent"):
        scorer.score(env_unpicklable, "1", env_unpicklable.get(1))


def test_a_worker_exits_when_its_parent_dies(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        sys.path.insert(0, sys.argv[1])
        from support.hostile_scorer import HostileScorerEnvironment
        from prime_node.node.environments.environment import ScoringLimits
        from prime_node.node.environments.scoring import BoundedScorer
        limits = ScoringLimits(isolation="process", wall_s=600, cpu_s=600)
        env = HostileScorerEnvironment(limits)
        scorer = BoundedScorer(limits)
        assert scorer.score(env, "1", env.get(1)) == 1.0
        print(scorer._worker.process.pid, flush=True)
        time.sleep(600)
        """
    )
    tests_dir = str(Path(__file__).parent)
    parent = subprocess.Popen([sys.executable, "-c", script, tests_dir], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        worker_pid = int(parent.stdout.readline())
        os.kill(worker_pid, 0)  # alive while its parent is
    finally:
        parent.kill()
        parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(worker_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"scoring worker {worker_pid} outlived its parent")
