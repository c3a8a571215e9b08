"""One spooled rollout file through the proofs/ checks, in phases around the checkpoint lookup.

Phase 1 (signature, schema, limits) needs no model, decodes nothing in bulk (the footer, the page headers
and the policy step column) and tells which checkpoint the file claims: a file over the run's limits is
rejected here, whichever step it claims, and never waits for a checkpoint; nor does one whose step is not
the one its envelope signs (`signer`: the envelope routed it here, trainer/validator/assignment.py). When
the validator does not hold the claimed checkpoint yet the outcome is `hold`, and the file is retried when
the version arrives. Then the rows are decoded and the signer checked (a node that re-signs another's rows
is named for that, fraud, not for repeating work the other node was credited for; so is one whose rows are
another batch than its envelope signs), and the work is looked up by what it is
(proofs/work_identity.py): a file whose rows repeat a sample, among themselves or one the ledger already
accepted in any file, is rejected as `duplicate` before any costly check (the ledger checks again,
atomically, when it records an acceptance). Phase 2 (every other check, cheapest first) runs against the
claimed checkpoint. Blocking (parquet decoding, torch): run it in the verification thread. The rows the
expensive checks cover are drawn here, after the file arrived, from the validator's own randomness
(proofs/verifier.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...node.engine import InferenceEngine
from ...node.run.validation import RunTasks
from ...proofs.checks import default_checks
from ...proofs.rollout_file import envelope_batch
from ...proofs.verifier import CheckResult, VerificationContext, VerifierSettings, run_checks
from ...proofs.work_identity import SampleId, first_repeat, sample_ids

# Checks that need neither the model nor the task rules; they must pass before the claimed step is looked up.
MODEL_FREE_CHECKS = frozenset({"signature", "schema", "limits"})
# The checks that say whose rows these are; the duplicate lookup runs right after the last of them.
IDENTITY_CHECKS = frozenset({"decode", "signer"})
DUPLICATE = "duplicate"  # the failed check of a file that repeats accepted (or its own) samples: a fault

ModelLookup = Callable[[int], "tuple[InferenceEngine, RunTasks] | None"]
# The first of these samples already accepted, with the hash of the file holding it (Ledger.accepted_holder).
AcceptedLookup = Callable[[Sequence[SampleId]], "tuple[SampleId, str] | None"]


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
    sample_ids: tuple[SampleId, ...] = ()  # what an accepted file's rows are, recorded with its verdict
    # The share of one unit of work an accepted file is credited: 1 for a rollout file, a stage's share of the
    # model's layers for a pipelined group's stage file (group_job.layer_share).
    credit_share: float = 1.0
    # Whether an accepted file goes into the trainer's inbox: a rollout file always; of a pipelined group's stage
    # files only the last stage's, which holds every sample (and the rollout proofs) once for the whole group.
    to_trainer: bool = True


def check_name(name: str) -> str:
    # Verdicts name checks as identifiers (a-z, 0-9, _); proofs/ spells a few with a hyphen.
    return name.replace("-", "_")


def _failure(results: tuple[CheckResult, ...]) -> tuple[str, str]:
    failed = next(c for c in results if c.status == "failed")
    where = f"row {failed.row}: " if failed.row is not None else ""
    # The check's name travels in the verdict's `failed_check`; the reason is what went wrong, without it (every
    # reader shows "check: reason", which a prefix here doubled: "sampling: sampling: ...").
    return check_name(failed.name), f"{where}{failed.detail}"


def duplicate_reason(ids: Sequence[SampleId], accepted: AcceptedLookup | None) -> str | None:
    """Why these rows are not new work (a verdict reason), or None when every sample is new."""
    repeat = first_repeat(ids)
    if repeat is not None:
        earlier, row = repeat
        return f"row {row}: repeats row {earlier} of this file ({ids[row].describe()})"
    held = accepted(ids) if accepted is not None else None
    if held is not None:
        sample, holder = held
        return f"row {ids.index(sample)}: sample ({sample.describe()}) was already accepted in file {holder}"
    return None


def verify_spooled(
    path: Path,
    lookup: ModelLookup,
    settings: VerifierSettings,
    rng: random.Random | None = None,
    accepted: AcceptedLookup | None = None,
) -> Outcome:
    start = time.perf_counter()
    checks = default_checks()
    head = [c for c in checks if c.name in MODEL_FREE_CHECKS]
    tail = [c for c in checks if c.name not in MODEL_FREE_CHECKS]
    # model and tasks are filled in once the claimed step is known; phase 1 never touches them.
    ctx = VerificationContext(
        path=Path(path),
        settings=settings,
        model=None,  # type: ignore[arg-type]
        tasks=None,  # type: ignore[arg-type]
        rng=rng or random.SystemRandom(),
    )
    first = run_checks(head, ctx)
    if not first.accepted:
        failed, reason = _failure(first.checks)
        seconds = time.perf_counter() - start
        return Outcome(False, 0, False, failed, reason, checks=first.checks, seconds=seconds)
    assert ctx.step is not None  # the limits check read it
    step = ctx.step
    claimed = envelope_batch(ctx.envelope)
    if claimed is not None and claimed[0] != step:
        # The signed envelope routed the file by another step than its rows hold: the `signer` check's failure
        # (fraud), named before the claimed step is looked up, so the lie is never held and excused.
        reason = f"the rows are policy step {step}, but the envelope signs policy step {claimed[0]}"
        seconds = time.perf_counter() - start
        return Outcome(False, step, False, "signer", reason, checks=first.checks, seconds=seconds)
    found = lookup(step)
    if found is None:
        return Outcome(True, step, seconds=time.perf_counter() - start)
    ctx.model, ctx.tasks = found
    identity = [c for c in tail if c.name in IDENTITY_CHECKS]
    rest = [c for c in tail if c.name not in IDENTITY_CHECKS]
    whose = run_checks(identity, ctx)
    if not whose.accepted:
        failed, reason = _failure(whose.checks)
        return Outcome(
            False,
            step,
            False,
            failed,
            reason,
            checks=first.checks + whose.checks,
            seconds=time.perf_counter() - start,
        )
    ids = sample_ids(ctx.rows)
    repeated = duplicate_reason(ids, accepted)
    if repeated is not None:
        return Outcome(
            False,
            step,
            False,
            DUPLICATE,
            repeated,
            checks=first.checks + whose.checks,
            seconds=time.perf_counter() - start,
        )
    second = run_checks(rest, ctx)
    results = first.checks + whose.checks + second.checks
    samples, tokens = len(ctx.rows), sum(len(r.output_ids) for r in ctx.rows)
    if second.accepted:
        rewards = sum(r.task_reward for r in ctx.rows)
        return Outcome(
            False,
            step,
            True,
            None,
            "",
            samples,
            tokens,
            results,
            time.perf_counter() - start,
            task_reward_sum=min(float(samples), max(0.0, rewards)),
            sample_ids=ids,
        )
    failed, reason = _failure(second.checks)
    return Outcome(False, step, False, failed, reason, samples, tokens, results, time.perf_counter() - start)
