"""Verification of a pipelined group's batch, and blame: which stage, if any, produced wrong work.

Cheapest first (docs/pipeline.md, "Trust"):
1. every stage's record is present, signed by the member the group names for that stage, for this batch;
2. hop consistency: for each hop k -> k + 1, the stream stage k recorded as sent and the stream stage k + 1
   recorded as received are the same headers under k's signed chain head. Each frame is signed, so a
   receiver's copy with a bad signature is its own forgery (k + 1 blamed), a strict prefix is a truncation
   by whoever holds less, and two validly signed streams that diverge are k's equivocation (k blamed);
   then each stage's sent frames acknowledge heads of its own copy of its input, signed by its predecessor for
   this batch's stream at their index, never going back (proofs/pipeline/acknowledgements.py): any other
   acknowledgement is the stage's own contradiction, except a signed head at an index its copy holds that
   differs there: the predecessor's equivocation;
3. tokens: the last stage's token frames hash to the outputs its record lists, every stage's end frame carries
   them (the first that does not is blamed: a middle stage learns them only from its predecessor's), and every
   stage lists them;
4. one monolithic prefill with hooks at every boundary recomputes what each honest stage sends; stage by
   stage in order, its sent frames' TOPLOC commitments are checked against the recomputed boundary, and the
   last stage's tokens must be the Gumbel-argmax of the recomputed logits. Because of (2), a stage's input
   is its predecessor's output, already found correct: the first stage that fails is the first whose output
   fails while its input matches, and it alone is blamed.
A receiver's fraud evidence (HopFraud: a signed frame whose commitment its own tensor belies) blames the
sender outright (`check_fraud`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from ...p2p.pipeline.errors import PipelineWireError
from ...p2p.pipeline.frames import FrameHeader, completions_sha256, decode_tensor, verify_chain
from ..bounds import CALIBRATED, ToplocThresholds
from ..errors import ProofError
from ..gumbel import gumbel_noise, perturbed_scores
from ..toploc import ChunkStats, build_proof, check_proof, worst_failure
from .acknowledgements import contradiction
from .records import GroupSpec, HopFraud, HopRecord, SignedStageRecord, StageRecord
from .schedule import fed_rows, micro_batches, sampled_rows


class Boundaries(Protocol):
    @property
    def states(
        self,
    ) -> list[torch.Tensor]:  # [j - 1]: what stage j - 1 sends, j = 1 .. stages (last: final normed)
        ...

    @property
    def logits(self) -> torch.Tensor: ...


class BoundaryPrefill(Protocol):
    def prefill(self, sequences: Sequence[Sequence[int]]) -> Sequence[Boundaries]: ...


class BlameThresholds(BaseModel):
    """TOPLOC bounds per boundary and the sampling margin (docs/pipeline.md, "Calibration")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    inner: ToplocThresholds = Field(
        default_factory=lambda: CALIBRATED["float32"], description="Bounds at boundaries between stages."
    )
    final: ToplocThresholds = Field(
        default_factory=lambda: CALIBRATED["float32"], description="Bounds on the last stage's final states."
    )
    margin: float = Field(0.05, ge=0, description="Score gap tolerated at a near-tie when checking sampling.")


@dataclass(frozen=True)
class GroupWork:
    """What the group was assigned, as the validator derives it."""

    prompts: Sequence[Sequence[int]]
    seeds: Sequence[int]
    temperature: float
    max_new_tokens: int
    eos_token_id: int
    micro_batch_size: int


@dataclass(frozen=True)
class GroupVerdict:
    blamed: int | None  # the faulty stage, None when the batch verifies
    reason: str

    @property
    def accepted(self) -> bool:
        return self.blamed is None


ACCEPTED = GroupVerdict(None, "every stage verifies")


def verify_group(
    spec: GroupSpec,
    records: Sequence[SignedStageRecord | None],
    work: GroupWork,
    oracle: BoundaryPrefill,
    thresholds: BlameThresholds | None = None,
) -> GroupVerdict:
    thresholds = thresholds or BlameThresholds()
    stages = spec.layout.stages
    for verdict in (_presence(spec, records), _hops(spec, records), _acknowledgements(spec, records)):
        if verdict is not None:
            return verdict
    present = [r.record for r in records if r is not None]
    outputs = present[-1].outputs
    verdict = _tokens(present, outputs, work)
    if verdict is not None:
        return verdict
    sequences = [list(p) + list(o) for p, o in zip(work.prompts, outputs, strict=True)]
    recomputed = oracle.prefill(sequences)
    schedule = micro_batches([len(p) for p in work.prompts], work.micro_batch_size)
    for k in range(stages):
        reason = _structure(present[k].sent.headers, schedule, outputs, work, last=k == stages - 1)
        if reason is not None:
            return GroupVerdict(k, f"stage {k}: {reason}")
    for k in range(stages):
        reason = (
            _check_tokens_frames(present[k].sent.headers, recomputed, work, outputs, thresholds)
            if k == stages - 1
            else _check_activation_frames(
                present[k].sent.headers, recomputed, work, outputs, k + 1, thresholds.inner
            )
        )
        if reason is not None:
            return GroupVerdict(k, f"stage {k}: {reason}")
    return ACCEPTED


def _presence(spec: GroupSpec, records: Sequence[SignedStageRecord | None]) -> GroupVerdict | None:
    if len(records) != spec.layout.stages:
        return GroupVerdict(len(records), f"{len(records)} stage records for {spec.layout.stages} stages")
    for k, signed in enumerate(records):
        if signed is None:
            return GroupVerdict(k, f"stage {k}: no record arrived within the grace period")
        record = signed.record
        if record.stage != k or record.node_id != spec.members[k] or not signed.is_authentic():
            return GroupVerdict(k, f"stage {k}: the record is not stage {k}'s, signed by its member")
        if record.sent.opening != spec.opening(k):
            return GroupVerdict(k, f"stage {k}: its stream's opening is not this group's batch")
    return None


def _hops(spec: GroupSpec, records: Sequence[SignedStageRecord | None]) -> GroupVerdict | None:
    stages = spec.layout.stages
    for k in range(stages):
        receiver = (k + 1) % stages
        sent, received = records[k].record.sent, records[receiver].record.received  # type: ignore[union-attr]
        if not _signed(sent, spec.members[k]):
            return GroupVerdict(k, f"stage {k}: its sent stream's chain head is not signed by it")
        if received.opening != sent.opening or not _signed(received, spec.members[k]):
            return GroupVerdict(
                receiver, f"stage {receiver}: its copy of stage {k}'s stream is not signed by {k}"
            )
        if sent.headers == received.headers:
            continue
        shorter = min(len(sent.headers), len(received.headers))
        if sent.headers[:shorter] == received.headers[:shorter]:
            who = k if len(sent.headers) < len(received.headers) else receiver
            return GroupVerdict(
                who, f"stage {who}: it recorded only part of the stream on hop {k} -> {receiver}"
            )
        return GroupVerdict(
            k, f"stage {k}: it signed two different streams on hop {k} -> {receiver} (equivocation)"
        )
    return None


def _acknowledgements(spec: GroupSpec, records: Sequence[SignedStageRecord | None]) -> GroupVerdict | None:
    """Each stage's sent frames acknowledge its own copy of its input (checked signed by `_hops`), in order."""
    stages = spec.layout.stages
    for k in range(stages):
        record = records[k].record  # type: ignore[union-attr]
        predecessor = (k - 1) % stages
        fault = contradiction(
            list(record.sent.headers),
            record.received.opening,
            list(record.received.headers),
            spec.members[predecessor],
        )
        if fault is not None:
            who = predecessor if fault.by_predecessor else k
            return GroupVerdict(who, f"stage {who}: {fault.reason}")
    return None


def _signed(hop: HopRecord, sender: str) -> bool:
    try:
        return verify_chain(
            sender, hop.opening, list(hop.headers), bytes.fromhex(hop.head), bytes.fromhex(hop.signature)
        )
    except ValueError:
        return False


def _tokens(
    present: Sequence[StageRecord], outputs: Sequence[Sequence[int]], work: GroupWork
) -> GroupVerdict | None:
    last = len(present) - 1
    if len(outputs) != len(work.prompts) or any(not 1 <= len(o) <= work.max_new_tokens for o in outputs):
        return GroupVerdict(last, f"stage {last}: its outputs do not fit the batch")
    covered = [0] * len(outputs)
    for header in present[last].sent.headers:
        if header.kind == "end":
            continue
        if header.kind != "tokens" or any(
            r >= len(outputs) or header.step >= len(outputs[r]) for r in header.rows
        ):
            return GroupVerdict(last, f"stage {last}: frame {header.index} does not fit its outputs")
        expected = np.array([outputs[r][header.step] for r in header.rows], dtype="<i8").tobytes()
        if hashlib.sha256(expected).hexdigest() != header.tensor_sha256:
            return GroupVerdict(
                last, f"stage {last}: the tokens it sent at step {header.step} are not its outputs"
            )
        for r in header.rows:
            covered[r] += 1
    if covered != [len(o) for o in outputs]:
        return GroupVerdict(last, f"stage {last}: its token frames do not carry every output token once")
    # Every stage's stream ends with one end frame carrying these completions: stage 0 received them in the token
    # frames, every later stage passes on its predecessor's end frame (a middle stage learns them only so), and
    # the last stage sampled them. In stage order, the first whose end frame carries others is blamed: its input
    # carried the right ones (hop consistency), so an honest stage that relayed a liar's is never named.
    due = completions_sha256(outputs, work.max_new_tokens)
    for k, record in enumerate(present):
        headers = record.sent.headers
        ends = [h for h in headers if h.kind == "end"]
        if len(ends) != 1 or headers[-1].kind != "end" or headers[-1].tensor_sha256 != due:
            return GroupVerdict(
                k, f"stage {k}: its stream does not end with one end frame carrying the batch's completions"
            )
    for k, record in enumerate(present[:-1]):
        if record.outputs != outputs:
            return GroupVerdict(k, f"stage {k}: its record lists other tokens than the last stage sampled")
    return None


def _structure(
    headers: Sequence[FrameHeader],
    schedule: list[list[int]],
    outputs: Sequence[Sequence[int]],
    work: GroupWork,
    *,
    last: bool,
) -> str | None:
    """Whether a stage sent exactly the frames the schedule and the outputs call for, with the right rows."""
    expected: set[tuple[str, int, int]] = set()
    for m, rows in enumerate(schedule):
        for step in range(work.max_new_tokens):
            if last:
                if sampled_rows(rows, step, outputs, work.eos_token_id, work.max_new_tokens):
                    expected.add(("tokens", m, step))
            elif step == 0:
                expected.add(("prefill", m, 0))
            if not last and fed_rows(rows, step, outputs, work.eos_token_id, work.max_new_tokens):
                expected.add(("decode", m, step))
    seen: set[tuple[str, int, int]] = set()
    for header in headers:
        if header.kind == "end":
            continue
        key = (header.kind, header.micro_batch, header.step)
        if key not in expected or key in seen:
            what = f"{header.kind} of micro-batch {header.micro_batch}, step {header.step}"
            return f"frame {header.index} ({what}) is not due"
        seen.add(key)
        rows = schedule[header.micro_batch]
        if header.kind == "prefill":
            due = rows
        elif header.kind == "decode":
            due = fed_rows(rows, header.step, outputs, work.eos_token_id, work.max_new_tokens)
        else:
            due = sampled_rows(rows, header.step, outputs, work.eos_token_id, work.max_new_tokens)
        if header.rows != due:
            return f"frame {header.index} carries rows {header.rows[:8]}, the schedule calls for {due[:8]}"
    missing = expected - seen
    if missing:
        kind, m, step = min(missing)
        return f"it never sent the {kind} frame of micro-batch {m}, step {step}"
    return None


def _rows(header: FrameHeader, work: GroupWork, outputs: Sequence[Sequence[int]]) -> list[tuple[int, slice]]:
    """(sample, positions) each row of an activation frame stands for: a prefill's prompt positions, or the
    position len(prompt) + step where a decode frame feeds output token `step`; ProofError when a row names
    no such position (the last output token is never fed)."""
    spans = []
    for r in header.rows:
        if r >= len(work.prompts):
            raise ProofError(f"frame {header.index} names sample {r}, outside the batch")
        n = len(work.prompts[r])
        if header.kind == "prefill":
            spans.append((r, slice(0, n)))
            continue
        position = n + header.step
        if header.step >= len(outputs[r]) - 1:
            raise ProofError(
                f"frame {header.index} names step {header.step} of sample {r}, which has no such token"
            )
        spans.append((r, slice(position, position + 1)))
    return spans


def _check_activation_frames(
    headers: Sequence[FrameHeader],
    recomputed: Sequence[Boundaries],
    work: GroupWork,
    outputs: Sequence[Sequence[int]],
    boundary: int,
    thresholds: ToplocThresholds,
) -> str | None:
    stats: list[ChunkStats] = []
    for header in headers:
        if header.kind == "end":
            continue
        if header.kind not in ("prefill", "decode"):
            return f"frame {header.index} is a {header.kind} frame on an activation hop"
        try:
            spans = _rows(header, work, outputs)
            rows = torch.cat([recomputed[r].states[boundary - 1][span] for r, span in spans])
            stats.extend(check_proof(bytes.fromhex(header.commitment or ""), rows))
        except ProofError as exc:
            return f"frame {header.index}: {exc}"
    failure = worst_failure(stats, thresholds)
    return None if failure is None else f"its activations are not the checkpoint's ({failure})"


def _check_tokens_frames(
    headers: Sequence[FrameHeader],
    recomputed: Sequence[Boundaries],
    work: GroupWork,
    outputs: Sequence[Sequence[int]],
    thresholds: BlameThresholds,
) -> str | None:
    stats: list[ChunkStats] = []
    for header in headers:
        if header.kind == "end":
            continue
        spans = []
        for r in header.rows:
            position = len(work.prompts[r]) - 1 + header.step  # the state that produced token `step`
            spans.append((r, position))
        rows = torch.stack([recomputed[r].states[-1][p] for r, p in spans])
        try:
            stats.extend(check_proof(bytes.fromhex(header.commitment or ""), rows))
        except ProofError as exc:
            return f"frame {header.index}: {exc}"
        logits = torch.stack([recomputed[r].logits[p] for r, p in spans])
        seeds = torch.tensor([work.seeds[r] for r, _ in spans], dtype=torch.int64)
        noise = gumbel_noise(seeds, torch.full_like(seeds, header.step), logits.shape[-1])
        scores = perturbed_scores(logits, work.temperature, noise)
        chosen = torch.tensor([outputs[r][header.step] for r, _ in spans])
        gap = scores.max(dim=-1).values - scores.gather(-1, chosen[:, None])[:, 0]
        if bool((gap > thresholds.margin).any()):
            worst = int(gap.argmax())
            return (
                f"token {header.step} of sample {spans[worst][0]} is not the Gumbel-argmax of the checkpoint's "
                f"logits (gap {float(gap[worst]):.3g} > {thresholds.margin})"
            )
    failure = worst_failure(stats, thresholds.final)
    return None if failure is None else f"its final hidden states are not the checkpoint's ({failure})"


def check_fraud(spec: GroupSpec, fraud: HopFraud, work: GroupWork) -> GroupVerdict:
    """A receiver's evidence against its predecessor: the sender is blamed when its signed frame's tensor does
    not give the commitment it signed; otherwise the evidence proves nothing (and no one is blamed by it)."""
    opening = fraud.hop.opening
    sender = opening.stage
    if (
        opening != spec.opening(sender)
        or not fraud.hop.headers
        or not _signed(fraud.hop, spec.members[sender])
    ):
        return GroupVerdict(None, "the fraud evidence is not a stream the accused signed")
    header = fraud.hop.headers[-1]
    if hashlib.sha256(fraud.tensor).hexdigest() != header.tensor_sha256 or header.kind not in (
        "prefill",
        "decode",
    ):
        return GroupVerdict(None, "the evidence's tensor is not the one the accused signed")
    try:
        tensor = decode_tensor(fraud.tensor, header.shape, header.dtype)
    except PipelineWireError as exc:
        return GroupVerdict(sender, f"stage {sender}: it signed a malformed tensor ({exc})")
    if header.kind == "prefill":
        width = tensor.shape[1]
        rows = torch.cat([tensor[b, width - len(work.prompts[r]) :] for b, r in enumerate(header.rows)])
    else:
        rows = tensor[:, -1]
    if build_proof(rows.float()).hex() != header.commitment:
        return GroupVerdict(
            sender, f"stage {sender}: frame {header.index}'s tensor belies the commitment it signed"
        )
    return GroupVerdict(None, "the accused frame's commitment matches its tensor")
