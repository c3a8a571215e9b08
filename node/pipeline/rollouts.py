"""What a member hands the validator: its stage file for a finished batch (proofs/pipeline/stage_file.py: the
group's rows plus its record); for a batch abandoned over a frame its commitment belies, the fraud evidence
against its predecessor; for a batch broken over a frame the schedule does not call for, its partial record
(proofs/pipeline/reports.py).

Every member writes the same rows: the assignment `work_for` derived (node/pipeline/work.py), the output tokens
every stage's record lists (the last stage sampled them and sent them to stage 0; a middle stage lists those
its predecessor's end frame carried), finish reasons read from the tokens, and rewards from the run's verifiers.
The last stage adds today's proofs (TOPLOC commitments of the final hidden states it kept, proofs/toploc.py); the
others none.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ...p2p.identity import Identity
from ...p2p.pipeline.layout import StageLayout, layout_digest
from ...proofs.assignment import Assignment
from ...proofs.pipeline.records import HopFraud, SignedStageRecord
from ...proofs.pipeline.reports import BatchClaim, PartialReport, report_of, write_report
from ...proofs.pipeline.stage_file import write_stage_file
from ...proofs.rollout_schema import RolloutRow
from ...proofs.toploc import build_proofs
from ..run.settings import RunSettings
from ..run.validation import RunTasks
from .work import GroupBatch, PipelineWork


def stage_rows(
    run: RunSettings,
    tasks: RunTasks,
    batch: GroupBatch,
    work: PipelineWork,
    assignment: Assignment,
    outputs: Sequence[Sequence[int]],
    node_id: str,
    final_states: Sequence[torch.Tensor] | None = None,
) -> list[RolloutRow]:
    """The rows of a member's file, in assignment order; `final_states` (last stage only) gives the proofs."""
    proofs = build_proofs(list(final_states)) if final_states is not None else [b""] * len(outputs)
    rows = []
    for (index, seed), request, tokens, proof in zip(
        assignment.rows(), work.requests, outputs, proofs, strict=True
    ):
        task_reward, penalty, target = tasks.rewards_for(index, seed, tokens)
        rows.append(
            RolloutRow(
                run_id=run.run_id,
                node_id=node_id,
                policy_step=batch.policy_step,
                batch_counter=batch.batch,
                sample_index=index,
                sample_seed=seed,
                temperature=run.temperature,
                max_new_tokens=run.max_new_tokens,
                environment=tasks.environment_pin,
                prompt_format=tasks.prompt_format,
                prompt_ids=tuple(request.prompt_ids),
                output_ids=tuple(tokens),
                finish_reason="eos" if work.eos_token_id in tokens else "length",
                task_reward=task_reward,
                length_penalty=penalty,
                reward=task_reward - penalty,
                target_length=target,
                proof=proof,
            )
        )
    return rows


def write_member_file(
    out: Path,
    run: RunSettings,
    tasks: RunTasks,
    batch: GroupBatch,
    work: PipelineWork,
    assignment: Assignment,
    members: tuple[str, ...],
    layout: StageLayout,
    nonce: str,
    signed: SignedStageRecord,
    identity: Identity,
    final_states: Sequence[torch.Tensor] | None = None,
) -> Path:
    """Write and sign `out` (and its v3 envelope) for this member's stage; returns the envelope's path."""
    rows = stage_rows(
        run, tasks, batch, work, assignment, signed.record.outputs, identity.node_id, final_states
    )
    return write_stage_file(
        out,
        rows,
        identity,
        members=members,
        layout_sha256=layout_digest(layout),
        nonce=nonce,
        micro_batch_size=batch.micro_batch_size,
        signed=signed,
    )


def write_member_report(
    out: Path,
    run: RunSettings,
    batch: GroupBatch,
    members: tuple[str, ...],
    layout: StageLayout,
    nonce: str,
    fraud: HopFraud,
    identity: Identity,
) -> Path:
    """Write and sign the evidence (FraudDetected.fraud) against this member's predecessor; the envelope's path."""
    report = report_of(
        fraud,
        run_id=run.run_id,
        members=members,
        layout=layout,
        nonce=nonce,
    )
    return write_report(out, report, identity)


def write_member_partial(
    out: Path,
    run: RunSettings,
    batch: GroupBatch,
    members: tuple[str, ...],
    layout: StageLayout,
    nonce: str,
    partial: SignedStageRecord,
    identity: Identity,
) -> Path:
    """Write and sign this member's partial record of a broken batch (BatchBroken.partial); the envelope's path."""
    claim = BatchClaim(
        run_id=run.run_id,
        policy_step=batch.policy_step,
        batch=batch.batch,
        members=list(members),
        prompts=batch.prompts,
        micro_batch_size=batch.micro_batch_size,
        layout_sha256=layout_digest(layout),
        nonce=nonce,
    )
    report = PartialReport(claim=claim, record=partial)
    return write_report(out, report, identity)
