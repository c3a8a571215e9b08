"""The composite rollout verifier: pluggable checks with one interface, run cheapest first.

A check reads and extends a shared `VerificationContext` (the file's bytes, then its rows, then the
evidence the prefill of the selected rows gives, proofs/evidence.py) and either returns a short summary
or raises `CheckFailed` naming the row and the reason. The first failure rejects the file; the checks
after it are reported as skipped. The expensive checks (TOPLOC, sampling, EOS probability, distribution)
look at a random subset of rows (`sample_fraction`), chosen with the verifier's own randomness so a node
cannot predict which rows are checked; any single failing row rejects the whole file.

What the verifier needs from the model and the task set is passed in as two small protocols, so this
package stays free of engines, tokenizers and task code (node/run/validation.py provides them).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow.parquet as pq

from .errors import ProofError
from .evidence import Prefilled, RowEvidence, batch_evidence, first_read_position, prefill_batches
from .rollout_layout import Layout
from .rollout_schema import RolloutRow
from .verifier_settings import VerifierSettings

logger = logging.getLogger(__name__)


class ModelOracle(Protocol):
    """The claimed checkpoint, as the verifier runs it (an InferenceEngine satisfies this)."""

    eos_token_id: int
    vocab_size: int

    def prefill(
        self, sequences: Sequence[Sequence[int]], keep_from: Sequence[int] | None = None
    ) -> Sequence[Prefilled]: ...


class TaskOracle(Protocol):
    """The run's task set and reward rules, as the verifier recomputes them."""

    task_count: int

    @property
    def environment_pin(self) -> str:
        """The run's environment as rows carry it (`NAME PACKAGE==VERSION sha256:<hex>`)."""
        ...

    @property
    def prompt_format(self) -> str:
        """How the run's prompts become token ids, as rows carry it."""
        ...

    def prompt_ids(self, sample_index: int, sample_seed: int) -> tuple[int, ...]:
        """The token ids of the prompt assigned to this sample."""
        ...

    def rewards(self, row: RolloutRow) -> tuple[float, float, int | None]:
        """(task reward, length penalty, target length) the row must carry."""
        ...


class CheckFailed(Exception):
    """Raised by a check: the file is rejected for `reason` (at `row` when one row is to blame)."""

    def __init__(self, reason: str, row: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.row = row


@dataclass
class VerificationContext:
    """State the checks share; later checks rely on what earlier ones established."""

    path: Path
    settings: VerifierSettings
    model: ModelOracle
    tasks: TaskOracle
    rng: random.Random
    data: bytes = b""
    envelope: dict[str, Any] = field(default_factory=dict)
    signer: str = ""
    # The opened file and what decoding it costs (proofs/rollout_layout.py), until its rows are decoded.
    parquet: pq.ParquetFile | None = None
    layout: Layout | None = None
    step: int | None = None  # the policy step every row claims, read before the rest of the file
    rows: list[RolloutRow] = field(default_factory=list)
    selected: list[int] = field(default_factory=list)  # rows the expensive checks cover
    evidence: dict[int, RowEvidence] = field(default_factory=dict)  # per selected row, see row_evidence

    def select_rows(self) -> list[int]:
        if not self.selected:
            n = len(self.rows)
            count = max(1, min(n, round(n * self.settings.sample_fraction)))
            self.selected = sorted(self.rng.sample(range(n), count))
        return self.selected

    def row_evidence(self) -> dict[int, RowEvidence]:
        """What the expensive checks read for every selected row: one prefill of prompt + output each, in
        bounded calls, every call reduced before the next runs (proofs/evidence.py); computed once, shared."""
        for _ in self.evidence_calls():
            pass
        return self.evidence

    def evidence_calls(self) -> Iterator[list[int]]:
        """Compute the evidence still missing call by call, yielding the rows each call covered, so that a
        check can reject before the rest is prefilled: a file of junk rows costs one call, not all of them."""
        missing = [i for i in self.select_rows() if i not in self.evidence]
        lengths = [len(self.rows[i].prompt_ids) + len(self.rows[i].output_ids) for i in missing]
        starts = [first_read_position(self.rows[i]) for i in missing]
        margin = self.settings.sampling_thresholds().margin
        for batch in prefill_batches(
            lengths,
            self.model.vocab_size,
            self.settings.prefill_batch_size,
            self.settings.prefill_max_logits_mib << 20,
            logit_rows=[lengths[k] - starts[k] for k in range(len(missing))],
        ):
            members = [missing[k] for k in batch]
            rows = [self.rows[i] for i in members]
            results = self.model.prefill(
                [r.prompt_ids + r.output_ids for r in rows], [starts[k] for k in batch]
            )
            try:
                found = batch_evidence(rows, results, margin, self.model.eos_token_id)
            except ProofError as exc:
                raise CheckFailed(str(exc)) from None
            del results  # before the next call runs: one call's logits alive at a time, not two
            self.evidence.update(zip(members, found, strict=True))
            yield members


class Check(Protocol):
    """One verification step; `run` returns a one-line summary or raises CheckFailed."""

    name: str

    def run(self, ctx: VerificationContext) -> str: ...


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # "passed", "failed" or "skipped"
    detail: str  # the summary, the failure reason, or why it was skipped
    row: int | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "row": self.row,
            "seconds": round(self.seconds, 4),
        }


@dataclass(frozen=True)
class VerificationReport:
    accepted: bool
    checks: tuple[CheckResult, ...]

    @property
    def reasons(self) -> list[str]:
        return [
            f"{c.name}: " + (f"row {c.row}: " if c.row is not None else "") + c.detail
            for c in self.checks
            if c.status == "failed"
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "checks": [c.as_dict() for c in self.checks],
            "reasons": self.reasons,
        }


def run_checks(checks: Sequence[Check], ctx: VerificationContext) -> VerificationReport:
    """Run `checks` in order; stop at the first failure and report the rest as skipped."""
    results: list[CheckResult] = []
    failed = False
    for check in checks:
        if failed:
            results.append(CheckResult(check.name, "skipped", "an earlier check rejected the file"))
            continue
        start = time.perf_counter()
        try:
            summary = check.run(ctx)
        except CheckFailed as exc:
            failed = True
            results.append(
                CheckResult(check.name, "failed", exc.reason, exc.row, time.perf_counter() - start)
            )
            logger.info("rollout file %s rejected by %s: %s", ctx.path, check.name, exc.reason)
        else:
            results.append(CheckResult(check.name, "passed", summary, None, time.perf_counter() - start))
    return VerificationReport(accepted=not failed, checks=tuple(results))
