"""One pipelined group's batch: its members' stage files judged together, one verdict per file.

Cheapest first (docs/pipeline.md, "Verdicts"):
1. each file alone (proofs/pipeline/stage_file.py): signature, schema, limits, the stage columns, the rows
   naming its signer; a file that fails is rejected for that check, as a rollout file would be;
2. the group: one file per stage of the run's layout (a second file for a stage is a `duplicate`); a group cut
   into another number of stages than the run's is every file's `run_parameters`;
3. each file's rows against the work `work_for` derives from the group (node/pipeline/work.py): the run's
   sampling settings (`run_parameters`), the assignment (`assignment`), the prompts (`prompts`), the rewards
   recomputed (`rewards`), and its rows and micro-batch cut against the cut its own signed sent frames show
   (`assignment`): each file is its signer's own claim, so a failure is that file's. Whether the stages' frames
   follow one another's cut is then verify_group's schedule and hop checks, which name the stage that deviated;
4. every stage present (else the group is incomplete: nobody is blamed, nobody credited);
5. `verify_group` (proofs/pipeline/blame.py) on the records, with one hooked prefill of the whole checkpoint;
   when it verifies, the last stage's termination and its rollout proofs (today's, per sample) against the
   same prefill.
Before any of this, the service admitted each file to its group only if it parses, its signer is a member of the
group it names and an operator-signed group record formed that group (`read_delivery`, formed_groups.py).
Verdict policy: the group verifies, every file is accepted (each member credited with its stage's share of the
layers, `layer_share`: one batch earns one unit however many stages ran it); a stage is blamed, its file
is rejected (`pipeline`, fraud: slashed and banned) and every other member's is rejected without penalty
(`pipeline_group`, excused): the batch passed through a faulty stage, so nobody is paid for it. Upheld fraud
evidence: its reporter excused (`pipeline_report_upheld`, not credited), the accused `pipeline` once per batch.
Blocking (Parquet, torch): run it in the verification thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...node.engine import HFEngine, InferenceEngine
from ...node.pipeline.boundaries import BoundaryOracle, SampleBoundaries
from ...node.pipeline.work import GroupBatch, frame_shapes, work_for
from ...node.run.settings import RunSettings
from ...node.run.validation import RunTasks
from ...p2p.pipeline.errors import PipelineWireError
from ...p2p.pipeline.layout import StageLayout
from ...proofs.errors import ProofError
from ...proofs.pipeline.blame import BlameThresholds, GroupVerdict, GroupWork, check_fraud, verify_group
from ...proofs.pipeline.broken import BatchRules, blame_broken, cut_of
from ...proofs.pipeline.records import GroupSpec, SignedStageRecord
from ...proofs.pipeline.reports import ReceivedPartial, ReceivedReport, read_fraud_report, read_partial_report
from ...proofs.pipeline.schedule import micro_batches
from ...proofs.pipeline.stage_file import StageFile, read_stage_file
from ...proofs.rollout_schema import RolloutFileError, RolloutLimits
from ...proofs.toploc import check_proof, committed_rows, worst_failure
from ...proofs.work_identity import sample_ids
from .verify_job import Outcome, check_name

BLAMED = "pipeline"  # the stage verify_group found faulty: fraud
GROUP_FAILED = "pipeline_group"  # an honest member of a group that failed elsewhere: excused, not credited
# A member of a group whose stages did not all arrive: excused, not credited.
INCOMPLETE = "pipeline_incomplete"
REPORT_FAILED = "pipeline_report"  # fraud evidence that proves nothing: its reporter's fault
# Fraud evidence that was upheld: excused, neither credited nor counted as accepted. Paying for it would let two
# sybils farm credit (and "established" standing) by one framing the other, a ban being cheap for a throwaway.
REPORT_UPHELD = "pipeline_report_upheld"

ModelLookup = Callable[[int], "tuple[InferenceEngine, RunTasks] | None"]


@dataclass(frozen=True)
class Delivery:
    """One member's file as the validator spooled it: a stage file, or a fraud report."""

    path: Path
    sender: str  # the envelope's signer
    kind: str = "stage"  # the v3 envelope's kind


Parsed = StageFile | ReceivedReport | ReceivedPartial


def read_delivery(delivery: Delivery, limits: RolloutLimits | None = None) -> Parsed:
    """A delivery read by the reader of its kind: its signature, schema and limits checked, its signer a member of
    the group it names (each reader checks that); RolloutFileError naming the check."""
    if delivery.kind == "fraud":
        return read_fraud_report(delivery.path, expected_signer=delivery.sender)
    if delivery.kind == "partial":
        return read_partial_report(delivery.path, expected_signer=delivery.sender)
    return read_stage_file(delivery.path, limits, expected_signer=delivery.sender)


def claimed_group(parsed: Parsed) -> tuple[str, tuple[str, ...], int, int]:
    """(group id, members in stage order, policy step, batch) a parsed delivery names."""
    if isinstance(parsed, StageFile):
        return parsed.group_id, parsed.members, *parsed.batch
    claim = parsed.claim if isinstance(parsed, ReceivedReport) else parsed.report.claim
    return claim.group_id, tuple(claim.members), claim.policy_step, claim.batch


def layer_share(layout: StageLayout, stage: int) -> float:
    """The share of the model's decoder layers stage `stage` runs: what its accepted file is credited (the
    shares of a group's stages add up to one batch's worth, as a monolithic node's file of the same rows)."""
    bounds = layout.boundaries
    return (bounds[stage + 1] - bounds[stage]) / (bounds[-1] - bounds[0])


@dataclass(frozen=True)
class Accusation:
    """A verdict on a node that delivered nothing: the accused of an upheld fraud report (on the report's hash)."""

    file_hash: str
    node_id: str
    outcome: Outcome
    group: str = (
        ""  # with node_id and batch: one accusation per (accused, group, batch), however many reports
    )
    batch: int = 0

    @property
    def key(self) -> tuple[str, str, int]:
        return self.node_id, self.group, self.batch


@dataclass
class GroupOutcome:
    """Per delivery (index into the deliveries), its outcome; or `hold`: the checkpoint is not held yet."""

    hold: bool = False
    step: int = 0
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    accusations: list[Accusation] = field(default_factory=list)


class _Recorded:
    """The oracle, keeping its last prefill: the last stage's rollout proofs are checked against it too."""

    def __init__(self, oracle: BoundaryOracle) -> None:
        self.oracle = oracle
        self.last: Sequence[SampleBoundaries] = []

    def prefill(self, sequences: Sequence[Sequence[int]]) -> Sequence[SampleBoundaries]:
        self.last = self.oracle.prefill(sequences)
        return self.last


def _reject(step: int, check: str, reason: str, parsed: StageFile | None = None) -> Outcome:
    samples = len(parsed.rows) if parsed is not None else 0
    return Outcome(False, step, False, check, reason, samples=samples)


def _accept(step: int, parsed: StageFile, last: bool, share: float) -> Outcome:
    rows = parsed.rows
    rewards = sum(r.task_reward for r in rows)
    return Outcome(
        False,
        step,
        True,
        None,
        "",
        len(rows),
        sum(len(r.output_ids) for r in rows),
        # The reward curve counts a group's samples once: from the last stage's file.
        task_reward_sum=min(float(len(rows)), max(0.0, rewards)) if last else None,
        sample_ids=sample_ids(rows),
        credit_share=share,
        to_trainer=last,  # the group's samples reach the trainer once: in the last stage's file
    )


def _row_fault(
    parsed: StageFile, run: RunSettings, tasks: RunTasks, work_rows: list[tuple[int, int]]
) -> tuple[str, str] | None:
    """The first check a file's rows fail against the group's derived work: (check, reason), or None."""
    rows = parsed.rows
    for i, r in enumerate(rows):
        if (
            r.run_id != run.run_id
            or r.temperature != run.temperature
            or r.max_new_tokens != run.max_new_tokens
        ):
            return "run_parameters", f"row {i}: run id, temperature or max_new_tokens is not the run's"
        if r.environment != tasks.environment_pin or r.prompt_format != tasks.prompt_format:
            return "run_parameters", f"row {i}: environment or prompt format is not the run's"
    if [(r.sample_index, r.sample_seed) for r in rows] != work_rows:
        return "assignment", "the rows are not the samples and seeds the group's batch is assigned"
    for i, r in enumerate(rows):
        if r.prompt_ids != tasks.prompt_ids(r.sample_index, r.sample_seed):
            return "prompts", f"row {i}: the prompt is not the task's"
        task_reward, penalty, target = tasks.rewards_for(r.sample_index, r.sample_seed, r.output_ids)
        if (
            not math.isclose(r.task_reward, task_reward, abs_tol=1e-9)
            or not math.isclose(r.length_penalty, penalty, abs_tol=1e-9)
            or r.target_length != target
        ):
            return (
                "rewards",
                f"row {i}: rewards differ from the run's verifiers ({r.task_reward} vs {task_reward})",
            )
    return None


def _cut(stage: StageFile) -> list[list[int]]:
    """The micro-batches a stage ran, read from the frames it sent and signed: a micro-batch's prefill carries all
    of its rows (stages before the last), and so does its tokens frame of step 0 (the last stage)."""
    firsts = [
        h
        for h in stage.record.record.sent.headers
        if h.kind == "prefill" or (h.kind == "tokens" and h.step == 0)
    ]
    return [list(h.rows) for h in sorted(firsts, key=lambda h: h.micro_batch)]


def _termination(outputs: Sequence[Sequence[int]], eos: int, max_new_tokens: int) -> str | None:
    for i, tokens in enumerate(outputs):
        if eos in tokens[:-1]:
            return f"sample {i} goes on after EOS"
        if tokens[-1] != eos and len(tokens) != max_new_tokens:
            return (
                f"sample {i} stops after {len(tokens)} tokens without EOS (max_new_tokens {max_new_tokens})"
            )
    return None


def _proofs(
    parsed: StageFile, recomputed: Sequence[SampleBoundaries], thresholds: BlameThresholds
) -> str | None:
    """The last stage's rollout proofs against the recomputed final normed states at the output positions."""
    for i, (row, states) in enumerate(zip(parsed.rows, recomputed, strict=True)):
        try:
            stats = check_proof(
                row.proof, states.states[-1][committed_rows(len(row.prompt_ids), len(row.output_ids))]
            )
        except ProofError as exc:  # a malformed proof is the file's fault, named
            return f"row {i}: {exc}"
        failure = worst_failure(stats, thresholds.final)
        if failure is not None:
            return f"row {i}: the rollout proof is not the checkpoint's final states ({failure})"
    return None


def _judge_reports(
    reports: dict[int, ReceivedReport],
    run: RunSettings,
    layout: StageLayout,
    tasks: RunTasks,
    eos: int,
    pad: int,
    hidden_size: int,
    result: GroupOutcome,
) -> tuple[int, str] | None:
    """check_fraud on each report: an upheld one excuses its reporter (`pipeline_report_upheld`, not credited)
    and accuses the stage it names once per (accused, group, batch) (returned with the reason); one that proves
    nothing is its reporter's fault (`pipeline_report`)."""
    upheld = None
    for d, received in reports.items():
        claim = received.claim
        step = claim.policy_step
        if len(claim.members) != layout.stages:
            result.outcomes[d] = _reject(step, "run_parameters", f"a group of {len(claim.members)} stages")
            continue
        batch = GroupBatch(claim.group_id, step, claim.batch, claim.prompts, claim.micro_batch_size)
        differs = batch.pinned_difference(layout)
        if differs is not None:  # the schedule the evidence is judged by is the run's, not the reporter's
            result.outcomes[d] = _reject(
                step, "run_parameters", f"a batch of another shape than the run's: {differs}"
            )
            continue
        try:
            work, _ = work_for(run, tasks, batch, eos_token_id=eos, pad_token_id=pad)
        except (ProofError, ValueError) as exc:
            result.outcomes[d] = _reject(
                step, REPORT_FAILED, f"the report names no batch of the group: {exc}"
            )
            continue
        spec = GroupSpec(run.run_id, step, claim.batch, layout, tuple(claim.members), claim.nonce)
        group_work = GroupWork(
            [r.prompt_ids for r in work.requests],
            [r.seed for r in work.requests],
            run.temperature,
            run.max_new_tokens,
            eos,
            claim.micro_batch_size,
        )
        try:  # the accused frame's declared shape is held to the schedule before its tensor is decoded
            evidence = received.evidence(frame_shapes(work, hidden_size, layout.activation_dtype))
            verdict = check_fraud(spec, evidence, group_work)
        except (IndexError, ProofError, ValueError, PipelineWireError) as exc:  # the claim does not fit its
            # evidence (a frame the schedule does not call for, rows it does not hold, a tensor no commitment can
            # be built for): the report's own fault, not the group's (an honest receiver refuses such a frame unread)
            verdict = GroupVerdict(None, f"the evidence does not fit its claim: {exc!r}")
        if verdict.blamed is None:
            result.outcomes[d] = _reject(
                step, REPORT_FAILED, f"the evidence proves nothing: {verdict.reason}"
            )
            continue
        result.outcomes[d] = _reject(step, REPORT_UPHELD, f"upheld: {verdict.reason}")
        accused = Outcome(False, step, False, BLAMED, f"{verdict.reason} (fraud evidence by its receiver)")
        accusation = Accusation(
            received.sha256, claim.members[verdict.blamed], accused, claim.group_id, claim.batch
        )
        if all(a.key != accusation.key for a in result.accusations):
            result.accusations.append(accusation)
        upheld = upheld or (verdict.blamed, verdict.reason)
    return upheld


def _judge_broken(
    partials: dict[int, ReceivedPartial],
    parsed: dict[int, StageFile],
    by_stage: dict[int, int],
    run: RunSettings,
    layout: StageLayout,
    tasks: RunTasks,
    eos: int,
    pad: int,
    result: GroupOutcome,
) -> GroupOutcome:
    """A batch that broke: blame_broken over every member's record as it stood (a partial report, or the stage
    file of a member that finished), one verdict per delivery (a stage is judged only on its own record)."""
    step = result.step
    records: list[SignedStageRecord | None] = [None] * layout.stages
    holder: dict[int, int] = {}  # stage -> the delivery its record came from
    for k, d in by_stage.items():
        records[k], holder[k] = parsed[d].record, d
    claim = None
    for d, partial in partials.items():
        k = partial.stage
        said = partial.report.claim
        shape = GroupBatch(said.group_id, step, said.batch, said.prompts, said.micro_batch_size)
        differs = shape.pinned_difference(layout)
        if len(partial.report.claim.members) != layout.stages:
            result.outcomes[d] = _reject(
                step, "run_parameters", f"a group of {len(partial.report.claim.members)} stages"
            )
        elif differs is not None:  # its record is not of the batch the run's shape makes: not used for blame
            result.outcomes[d] = _reject(
                step, "run_parameters", f"a batch of another shape than the run's: {differs}"
            )
        elif k in holder:
            result.outcomes[d] = _reject(step, "duplicate", f"a second record for stage {k} of this batch")
        else:
            records[k], holder[k] = partial.report.record, d
            claim = partial.report.claim if k == 0 else claim
    # Every claim here names the one group id, the digest of members and nonce among others: any claim's do.
    any_claim = next(iter(partials.values())).report.claim
    members = any_claim.members
    if len(members) != layout.stages:  # every record of the group names the same members: all refused above
        return result
    spec = GroupSpec(run.run_id, step, any_claim.batch, layout, tuple(members), any_claim.nonce)
    cut = None
    if claim is not None:  # stage 0's own claim of the batch it cut (signed by it, of the run's shape: above)
        try:
            batch = GroupBatch.pinned(layout, claim.group_id, step, claim.batch)
            work, _ = work_for(run, tasks, batch, eos_token_id=eos, pad_token_id=pad)
            cut = cut_of([r.prompt_ids for r in work.requests], batch.micro_batch_size)
        except (ProofError, ValueError):
            cut = None
    verdict = blame_broken(spec, records, BatchRules(eos, run.max_new_tokens, cut))
    for k, d in holder.items():
        if verdict.blamed == k:
            result.outcomes[d] = _reject(step, BLAMED, verdict.reason)
        else:
            result.outcomes[d] = _reject(step, INCOMPLETE, f"the batch broke mid-way: {verdict.reason}")
    return result


def _shape_difference(f: StageFile, run: RunSettings, layout: StageLayout) -> str | None:
    """None when stage file `f` holds a batch of the run's pinned shape (`layout.prompts` problems of
    `run.samples` rows each, cut into micro-batches of `layout.micro_batch_size`); else what differs."""
    found = []
    if len(f.rows) != layout.prompts * run.samples:
        found.append(f"{len(f.rows)} rows, the run's {layout.prompts} prompts x {run.samples} samples")
    if f.micro_batch_size != layout.micro_batch_size:
        found.append(f"micro_batch_size {f.micro_batch_size}, the run's {layout.micro_batch_size}")
    return "; ".join(found) or None


def verify_group_files(
    deliveries: Sequence[Delivery],
    run: RunSettings,
    layout: StageLayout,
    lookup: ModelLookup,
    *,
    complete: bool,
    limits: RolloutLimits | None = None,
    thresholds: BlameThresholds | None = None,
) -> GroupOutcome:
    """Judge one group's batch from its members' deliveries; `complete`: the grace period is over (or every
    stage is in), so a missing stage makes the group incomplete."""
    thresholds = thresholds or BlameThresholds()
    result = GroupOutcome()
    parsed: dict[int, StageFile] = {}
    reports: dict[int, ReceivedReport] = {}
    partials: dict[int, ReceivedPartial] = {}
    for d, delivery in enumerate(deliveries):
        try:
            read = read_delivery(delivery, limits)
        except RolloutFileError as exc:
            result.outcomes[d] = _reject(0, check_name(exc.check), str(exc))
            continue
        if isinstance(read, ReceivedReport):
            reports[d] = read
        elif isinstance(read, ReceivedPartial):
            partials[d] = read
        else:
            parsed[d] = read
    if not parsed and not reports and not partials:
        return result
    claims = [r.claim for r in reports.values()] + [p.report.claim for p in partials.values()]
    step = next(iter(parsed.values())).batch[0] if parsed else claims[0].policy_step
    result.step = step
    by_stage: dict[int, int] = {}
    for d, f in parsed.items():
        if len(f.members) != layout.stages:
            result.outcomes[d] = _reject(
                step,
                "run_parameters",
                f"a group of {len(f.members)} stages; the run's layout has {layout.stages}",
                f,
            )
        elif (differs := _shape_difference(f, run, layout)) is not None:
            # The run pins the batch's shape (run.pipeline): a file of another is not the run's work, whatever
            # its frames show (an honest member derives its batch from the pinned values alone).
            result.outcomes[d] = _reject(
                step, "run_parameters", f"a batch of another shape than the run's: {differs}", f
            )
        elif f.stage in by_stage:
            result.outcomes[d] = _reject(
                step, "duplicate", f"a second file for stage {f.stage} of this batch", f
            )
        else:
            by_stage[f.stage] = d
    if not by_stage and not reports and not partials:
        return result
    found = lookup(step)
    if found is None:
        return GroupOutcome(hold=True, step=step, outcomes=result.outcomes)
    engine, tasks = found
    if not isinstance(engine, HFEngine):  # the hooked prefill runs the transformers model (vLLM: not built)
        raise TypeError(
            f"a group's boundary prefill needs the transformers engine, not {type(engine).__name__}"
        )
    eos, pad = engine.eos_token_id, engine.pad_token_id
    blamed = _judge_reports(reports, run, layout, tasks, eos, pad, engine.model.config.hidden_size, result)
    if blamed is not None:  # proven fraud: the batch is void; the accused's own file (if any) blamed with it
        stage, reason = blamed
        for k, d in by_stage.items():
            check = BLAMED if k == stage else GROUP_FAILED
            result.outcomes[d] = _reject(
                step, check, reason if k == stage else f"another stage blamed: {reason}"
            )
        for d in partials:
            result.outcomes[d] = _reject(step, GROUP_FAILED, f"another stage blamed: {reason}")
        return result
    if partials and len(by_stage) == layout.stages:  # every stage finished: a partial record cannot void that
        for d in partials:
            result.outcomes[d] = _reject(
                step, "duplicate", "a partial record of a batch whose stages all finished"
            )
        partials = {}
    if partials:  # the batch broke: judged from the partial records once all are in, or when time is up
        stages_in = {p.stage for p in partials.values()} | set(by_stage)
        if not complete and len(stages_in) < layout.stages:
            return GroupOutcome(step=step)
        return _judge_broken(partials, parsed, by_stage, run, layout, tasks, eos, pad, result)
    if not by_stage:
        return result if complete else GroupOutcome(step=step)  # reports that proved nothing: wait for files
    for stage, d in list(by_stage.items()):  # each file's rows against its own claim of the group's batch
        f = parsed[d]
        # The file's shape is the run's (checked above): its batch is the pinned one of its number.
        claim = GroupBatch.pinned(layout, f.group_id, step, f.batch[1])
        try:
            _, assignment = work_for(run, tasks, claim, eos_token_id=eos, pad_token_id=pad)
            fault = _row_fault(f, run, tasks, list(assignment.rows()))
        except (
            ProofError,
            ValueError,
        ) as exc:  # AssignmentError (no batch has these many rows), PipelineWork
            fault = "assignment", f"no batch of the group has these rows: {exc}"
        if fault is not None:
            result.outcomes[d] = _reject(step, fault[0], fault[1], f)
            del by_stage[stage]
    for stage, d in list(by_stage.items()):
        # Each file's rows and micro-batch cut against the frames its own signed record says it sent. A file that
        # contradicts them lies about its own batch (an honest member writes both from one work): its fault alone.
        # Files that agree with their own frames go on even if their cuts differ: whose frames left the cut the
        # group ran is then settled by verify_group on the signed streams (a stage whose frames do not follow what
        # it received is named there), so a later stage recording another cut cannot void the batch.
        f = parsed[d]
        claimed = micro_batches([len(r.prompt_ids) for r in f.rows], f.micro_batch_size)
        if claimed != _cut(f):
            result.outcomes[d] = _reject(
                step,
                "assignment",
                "the rows or their micro-batch cut are not the frames it sent and signed",
                f,
            )
            del by_stage[stage]
    if len(by_stage) < layout.stages:
        if not complete:
            return GroupOutcome(hold=False, step=step, outcomes={})  # wait for the rest (the caller's grace)
        missing = sorted(set(range(layout.stages)) - set(by_stage))
        reason = f"stages {missing} of the group did not hand in a valid file within the grace period"
        for d in by_stage.values():
            result.outcomes[d] = _reject(step, INCOMPLETE, reason, parsed[d])
        return result
    first = parsed[by_stage[0]]
    batch = GroupBatch.pinned(layout, first.group_id, step, first.batch[1])
    work, _ = work_for(run, tasks, batch, eos_token_id=eos, pad_token_id=pad)
    spec = GroupSpec(run.run_id, step, batch.batch, layout, first.members, first.nonce)
    records = [parsed[by_stage[k]].record for k in range(layout.stages)]
    group_work = GroupWork(
        [r.prompt_ids for r in work.requests],
        [r.seed for r in work.requests],
        run.temperature,
        run.max_new_tokens,
        eos,
        batch.micro_batch_size,
    )
    oracle = _Recorded(BoundaryOracle(engine.model, layout))
    with torch.inference_mode():
        verdict = verify_group(spec, records, group_work, oracle, thresholds)
    last = layout.stages - 1
    if verdict.accepted:
        late = _termination(records[last].record.outputs, eos, run.max_new_tokens) or _proofs(
            parsed[by_stage[last]], oracle.last, thresholds
        )
        if late is not None:
            verdict = GroupVerdict(last, f"stage {last}: {late}")
    for k, d in by_stage.items():
        f = parsed[d]
        if verdict.accepted:
            result.outcomes[d] = _accept(step, f, k == last, layer_share(layout, k))
        elif verdict.blamed == k:
            result.outcomes[d] = _reject(step, BLAMED, verdict.reason, f)
        else:
            result.outcomes[d] = _reject(
                step,
                GROUP_FAILED,
                f"the group's batch was rejected, another stage blamed: {verdict.reason}",
                f,
            )
    return result
