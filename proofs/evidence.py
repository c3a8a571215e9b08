"""What the expensive checks read from the claimed model's prefill, reduced batch by batch.

A prefill returns float32 logits for every position it keeps: (positions x vocabulary) per row, 594 KiB per
position for a 152k-token vocabulary; it keeps those from the prompt's last token on (the output's), since
the checks read nothing before. Holding them for a whole file until the last check ran made a
validator's memory grow with the file (rows x tokens x vocabulary), which a node chooses. So each prefill
call is cut to a bound in rows and in logits bytes, and its results are reduced at once to what the checks
need (TOPLOC chunk statistics, the Gumbel replay's statistics and log p(EOS) where an `eos` sample ended)
before the next call runs: peak memory is one call's logits (the limit, or one row's when a single row is
larger: at most max_new_tokens + 1 positions, the run's pin checked before any prefill), whatever the number
of rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .errors import ProofError
from .rollout_schema import RolloutRow
from .sampling import SamplingStats, eos_logprob, replay_samplings
from .toploc import ChunkStats, check_proofs, committed_rows

LOGIT_BYTES = 4  # prefills return float32 logits


class Prefilled(Protocol):
    """Row i is position first_position + i of the sequence (the verifier keeps from the prompt's last token).
    Read-only, so that frozen results (node/engine/types.py PrefillResult) satisfy it."""

    @property
    def hidden_states(self) -> torch.Tensor:
        """(L - first_position, hidden) last hidden states after the final norm."""
        ...

    @property
    def logits(self) -> torch.Tensor:
        """(L - first_position, vocab) float32; row i predicts the token after its position."""
        ...

    @property
    def first_position(self) -> int: ...


def first_read_position(row: RolloutRow) -> int:
    """The first position whose prefill the checks read: the prompt's last, whose logits drew output token 0
    (committed_rows). Nothing before it is returned by the prefill: a prompt's logits are never read."""
    return committed_rows(len(row.prompt_ids), len(row.output_ids)).start


@dataclass(frozen=True)
class RowEvidence:
    """One selected row's prefill, reduced to what the TOPLOC, EOS, sampling and distribution checks read."""

    toploc: list[ChunkStats] | ProofError  # per chunk, or why the proof is malformed
    sampling: SamplingStats
    eos_logprob: float | None  # log p(EOS) under softmax(logits / T) where the row ended on EOS; else None


def prefill_batches(
    lengths: Sequence[int],
    vocab_size: int,
    max_rows: int,
    max_logit_bytes: int,
    logit_rows: Sequence[int] | None = None,
) -> list[list[int]]:
    """Row indices cut into prefill calls, longest first (similar lengths pad little): each call holds at most
    `max_rows` rows and `max_logit_bytes` of logits (`logit_rows[i]` positions of them for row i: all its
    `lengths[i]` by default), and at least one row whatever its size."""
    kept = lengths if logit_rows is None else logit_rows
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    held = 0
    for i in order:
        size = kept[i] * vocab_size * LOGIT_BYTES
        if not batches or len(batches[-1]) >= max_rows or held + size > max_logit_bytes:
            batches.append([])
            held = 0
        batches[-1].append(i)
        held += size
    return batches


def batch_evidence(
    rows: Sequence[RolloutRow], results: Sequence[Prefilled], margin: float, eos_token_id: int
) -> list[RowEvidence]:
    """Reduce one prefill call's results (one per row, same order) to numbers: nothing returned refers to
    its tensors, and nothing kept grows with the vocabulary."""
    temperatures = {r.temperature for r in rows}
    if len(temperatures) != 1:  # the bounds check refuses such files before any prefill
        raise ProofError(f"rows of one file disagree on the temperature: {sorted(temperatures)}")
    # The committed rows, counted from each result's first returned position.
    spans = [
        _shifted(committed_rows(len(r.prompt_ids), len(r.output_ids)), res.first_position)
        for r, res in zip(rows, results, strict=True)
    ]
    chunk_stats = check_proofs(
        [r.proof for r in rows], [res.hidden_states[span] for res, span in zip(results, spans, strict=True)]
    )
    temperature = temperatures.pop()
    replays = replay_samplings(
        [res.logits[span] for res, span in zip(results, spans, strict=True)],
        [r.output_ids for r in rows],
        [r.sample_seed for r in rows],
        temperature,
        margin,
    )
    eos = [
        eos_logprob(res.logits[span.stop - 1], eos_token_id, temperature)
        if r.finish_reason == "eos"
        else None
        for r, res, span in zip(rows, results, spans, strict=True)
    ]
    return [RowEvidence(t, s, e) for t, s, e in zip(chunk_stats, replays, eos, strict=True)]


def _shifted(span: slice, first_position: int) -> slice:
    if span.start < first_position:  # the model oracle's bug, never the file's: no rejection (no ProofError)
        raise RuntimeError(
            f"the prefill returned positions from {first_position}; the checks read from {span.start}"
        )
    return slice(span.start - first_position, span.stop - first_position)
