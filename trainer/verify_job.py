"""One spooled rollout file through the proofs/ checks, in two phases around the checkpoint lookup.

Phase 1 (signature, schema, limits) needs no model, decodes nothing in bulk (the footer, the page headers
and the policy step column) and tells which checkpoint the file claims: a file over the run's limits is
rejected here, whichever step it claims, and never waits for a checkpoint. Phase 2 (decoding the rows,
then every other check, cheapest first) runs against that checkpoint. When the validator does not hold it
yet the outcome is `hold`, and the file is retried when the version arrives. Blocking (parquet decoding, torch):
run it in the verification thread. The rows the expensive checks cover are drawn here, after the file
arrived, from the validator's own randomness (proofs/verifier.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..node.engine import InferenceEngine
from ..node.validation import RunTasks
from ..proofs.checks import default_checks
from ..proofs.verifier import CheckResult, VerificationContext, VerifierSettings, run_checks

# Checks that need neither the model nor the task rules; they must pass before the claimed step is looked up.
MODEL_FREE_CHECKS = frozenset({"signature", "schema", "limits"})

ModelLookup = Callable[[int], "tuple[InferenceEngine, RunTasks] | None"]


@dataclass(frozen=True)
class Outcome:
    """A decision (accepted, or the first failed check), or `hold`: the claimed checkpoint is not held."""

    hold: bool
    step: int
    accepted: bool = False
    failed_check: str | None = None
    reason: str = ""
    samples: int = 0
    tokens: int = 0
    checks: tuple[CheckResult, ...] = ()
    seconds: float = 0.0
    # Sum of the rows' task rewards of an accepted file: the rewards check recomputed each of them with the
    # run's verifiers over every row, so these are the validator's numbers, not the sender's claims.
    task_reward_sum: float | None = None


def check_name(name: str) -> str:
    # Verdicts name checks as identifiers (a-z, 0-9, _); proofs/ spells a few with a hyphen.
    return name.replace("-", "_")


def _failure(results: tuple[CheckResult, ...]) -> tuple[str, str]:
    failed = next(c for c in results if c.status == "failed")
    where = f"row {failed.row}: " if failed.row is not None else ""
    return check_name(failed.name), f"{failed.name}: {where}{failed.detail}"


def verify_spooled(
    path: Path, lookup: ModelLookup, settings: VerifierSettings, rng: random.Random | None = None
) -> Outcome:
    start = time.perf_counter()
    checks = default_checks()
    head = [c for c in checks if c.name in MODEL_FREE_CHECKS]
    tail = [c for c in checks if c.name not in MODEL_FREE_CHECKS]
    # model and tasks are filled in once the claimed step is known; phase 1 never touches them.
    ctx = VerificationContext(
        path=Path(path), settings=settings, model=None, tasks=None,  # type: ignore[arg-type]
        rng=rng or random.SystemRandom(),
    )
    first = run_checks(head, ctx)
    if not first.accepted:
        failed, reason = _failure(first.checks)
        seconds = time.perf_counter() - start
        return Outcome(False, 0, False, failed, reason, checks=first.checks, seconds=seconds)
    assert ctx.step is not None  # the limits check read it
    step = ctx.step
    found = lookup(step)
    if found is None:
        return Outcome(True, step, seconds=time.perf_counter() - start)
    ctx.model, ctx.tasks = found
    second = run_checks(tail, ctx)
    results = first.checks + second.checks
    samples, tokens = len(ctx.rows), sum(len(r.output_ids) for r in ctx.rows)
    if second.accepted:
        rewards = sum(r.task_reward for r in ctx.rows)
        return Outcome(False, step, True, None, "", samples, tokens, results, time.perf_counter() - start,
                       task_reward_sum=min(float(samples), max(0.0, rewards)))
    failed, reason = _failure(second.checks)
    return Outcome(False, step, False, failed, reason, samples, tokens, results, time.perf_counter() - start)
