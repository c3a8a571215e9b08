"""Completions crafted to be slow for real scorers (huge numbers, deep LaTeX nesting, pathological regex
input; tests/support/scorer_attacks.py) are cut at the bound and score 0, and an honest answer right after
each scores 1: the bounded scorer (node/environments/scoring.py) with math-verify and reasoning-gym."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from prime_node.node.environments.environment import Environment, ScoringLimits
from prime_node.node.environments.math import open_math
from prime_node.node.environments.reasoning_gym import open_reasoning_gym
from prime_node.node.environments.scoring import BoundedScorer

from support.scorer_attacks import MATH_ATTACKS, REASONING_GYM_ATTACKS

# Shorter than the environments' own 5 s so that the suite stays quick; the benchmark uses theirs.
LIMITS = ScoringLimits(isolation="process", wall_s=2.0, cpu_s=2.0, memory_mb=2048)
SLACK_S = 10.0  # the kill, and a busy two-core machine


def _math_env(tmp_path: Path) -> Environment:
    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps({"problem": "What is 1/2 + 1/4?", "answer": r"\frac{3}{4}"}) + "\n")
    return open_math(f"path={path}")


def _attack(scorer: BoundedScorer, env: Environment, attacks: dict[str, str], honest: str) -> None:
    task = env.get(0)
    assert scorer.score(env, honest, task) == 1.0  # honest control first; also loads the worker
    for name, completion in attacks.items():
        started = time.monotonic()
        assert scorer.score(env, completion, task) == 0.0, name
        assert time.monotonic() - started < LIMITS.wall_s + SLACK_S, name
        assert scorer.score(env, honest, task) == 1.0, f"honest answer after {name}"


def test_crafted_completions_are_cut_at_the_bound_and_score_zero(tmp_path: Path) -> None:
    math_env = _math_env(tmp_path)
    integration = open_reasoning_gym("family=simple_integration", seed=1)
    with BoundedScorer(LIMITS) as scorer:
        picked = {k: MATH_ATTACKS[k] for k in ("power_tower", "deep_frac")}
        _attack(scorer, math_env, picked, r"\boxed{0.75}")
        _attack(
            scorer,
            integration,
            {"power_tower": REASONING_GYM_ATTACKS["power_tower"]},
            integration.get(0).answer,
        )
        assert scorer.breaches["wall"] + scorer.breaches["cpu"] == 3


@pytest.mark.slow
def test_every_crafted_completion_scores_zero_within_the_bound(tmp_path: Path) -> None:
    with BoundedScorer(LIMITS) as scorer:
        _attack(scorer, _math_env(tmp_path), MATH_ATTACKS, r"\boxed{0.75}")
        for family in ("simple_integration", "intermediate_integration", "chain_sum"):
            env = open_reasoning_gym(f"family={family}", seed=1)
            _attack(scorer, env, REASONING_GYM_ATTACKS, env.get(0).answer)
