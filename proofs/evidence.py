"""What the expensive checks read from the claimed model's prefill, reduced batch by batch.

A prefill returns float32 logits for every position: (positions x vocabulary) per row, 594 KiB per
position for a 152k-token vocabulary. Holding them for a whole file until the last check ran made a
validator's memory grow with the file (rows x tokens x vocabulary), which a node chooses. So each prefill
call is cut to a bound in rows and in logits bytes, and its results are reduced at once to what the checks
need (TOPLOC chunk statistics, the Gumbel replay's statistics and log p(EOS) where an `eos` sample ended)
before the next call runs: peak memory is one call's logits (the limit, or one row's when a single row is
larger: its length is bounded by the run's prompts and max_new_tokens, checked before any prefill), whatever
the number of rows.
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
    hidden_states: torch.Tensor  # (L, hidden) last hidden states after the final norm
    logits: torch.Tensor  # (L, vocab) float32; row i predicts token i + 1


@dataclass(frozen=True)
class RowEvidence:
    """One selected row's prefill, reduced to what the TOPLOC, EOS, sampling and distribution checks read."""

    toploc: list[ChunkStats] | ProofError  # per chunk, or why the proof is malformed
    sampling: SamplingStats
    eos_logprob: float | None  # log p(EOS) under softmax(logits / T) where the row ended on EOS; else None


def prefill_batches(lengths: Sequence[int], vocab_size: int, max_rows: int, max_logit_bytes: int) -> list[list[int]]:
    """Row indices cut into prefill calls, longest first (similar lengths pad little): each call holds at most
    `max_rows` rows and `max_logit_bytes` of logits, and at least one row whatever its size."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    held = 0
    for i in order:
        size = lengths[i] * vocab_size * LOGIT_BYTES
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
    spans = [committed_rows(len(r.prompt_ids), len(r.output_ids)) for r in rows]
    chunk_stats = check_proofs([r.proof for r in rows],
                               [res.hidden_states[span] for res, span in zip(results, spans, strict=True)])
    temperature = temperatures.pop()
    replays = replay_samplings([res.logits[span] for res, span in zip(results, spans, strict=True)],
                               [r.output_ids for r in rows], [r.sample_seed for r in rows], temperature, margin)
    eos = [eos_logprob(res.logits[span.stop - 1], eos_token_id, temperature) if r.finish_reason == "eos" else None
           for r, res, span in zip(rows, results, spans, strict=True)]
    return [RowEvidence(t, s, e) for t, s, e in zip(chunk_stats, replays, eos, strict=True)]
