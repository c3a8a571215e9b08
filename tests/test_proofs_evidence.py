"""The expensive checks' evidence is reduced prefill call by prefill call: the validator's memory is bounded
by one call's logits (rows and bytes), whatever the file holds, and the verdict does not depend on the cut."""

from __future__ import annotations

import dataclasses
import gc
import random
import weakref
from collections.abc import Sequence
from pathlib import Path

import pytest

from prime_node.node.engine import HFEngine, PrefillResult
from prime_node.node.run.validation import verify_rollout_file
from prime_node.proofs.checks import default_checks
from prime_node.proofs.evidence import LOGIT_BYTES, prefill_batches
from prime_node.proofs.sampling import eos_logprob, replay_samplings
from prime_node.proofs.toploc import check_proofs, committed_rows
from prime_node.proofs.verifier import VerificationContext, VerificationReport, VerifierSettings, run_checks

from support.attack import SPEC, build_world, honest_rows, rejected_by, write_honest, write_signed


def test_prefill_batches_bound_rows_and_bytes_longest_first():
    lengths = [10, 50, 30, 20, 40]
    assert prefill_batches(lengths, vocab_size=1, max_rows=2, max_logit_bytes=1 << 30) == [
        [1, 4],
        [2, 3],
        [0],
    ]
    # 70 positions of logits per call: 50 alone (50 + 40 > 70), then 40 + 30, then 20 + 10.
    assert prefill_batches(lengths, 1, 16, 70 * LOGIT_BYTES) == [[1], [4, 2], [3, 0]]
    # A sequence over the budget still gets a call of its own; nothing is dropped or repeated.
    assert prefill_batches([500, 5, 600], 1, 16, 100 * LOGIT_BYTES) == [[2], [0], [1]]
    assert prefill_batches([], 1, 16, 1) == []


class RecordingModel:
    """The real engine; it notes how many logits bytes each prefill call returned, and how many logits
    tensors of earlier calls were still alive when a call began."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine, self.calls, self.alive_at_call, self._earlier = engine, [], [], []
        self.eos_token_id, self.vocab_size = engine.eos_token_id, engine.vocab_size

    def prefill(
        self, sequences: Sequence[Sequence[int]], keep_from: Sequence[int] | None = None
    ) -> list[PrefillResult]:
        gc.collect()
        self.alive_at_call.append(sum(ref() is not None for ref in self._earlier))
        results = self.engine.prefill(sequences, keep_from)
        self.calls.append((len(results), sum(r.logits.numel() * r.logits.element_size() for r in results)))
        self._earlier += [weakref.ref(r.logits) for r in results]
        return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    engine, tasks, _ = build_world(tmp_path_factory.mktemp("ckpt"))
    return engine, tasks, honest_rows(engine, tasks, dataclasses.replace(SPEC, prompts=12))  # 24 rows


def _verify(world, path: Path, **settings) -> tuple[VerificationReport, RecordingModel]:
    engine, tasks, _ = world
    model = RecordingModel(engine)
    return verify_rollout_file(path, model, tasks, _settings(**settings), rng=random.Random(0)), model


def _settings(**settings) -> VerifierSettings:
    return VerifierSettings(run_seed=SPEC.run_seed, samples_per_prompt=SPEC.samples, **settings)


def test_the_verdict_does_not_depend_on_how_prefill_calls_are_cut(world, tmp_path: Path):
    path = write_honest(tmp_path / "honest.parquet", world[2])
    whole, whole_model = _verify(world, path)
    assert whole.accepted and [rows for rows, _ in whole_model.calls] == [16, 8]
    # Logits only from each prompt's last token on (output + 1 positions a row): a prompt's are never read.
    kept = sum(len(r.output_ids) + 1 for r in world[2]) * world[0].vocab_size * LOGIT_BYTES
    assert sum(nbytes for _, nbytes in whole_model.calls) == kept
    by_bytes, model = _verify(world, path, prefill_max_logits_mib=1)  # the 24 rows keep ~1.1 MiB of logits
    assert len(model.calls) >= 2 and max(nbytes for _, nbytes in model.calls) <= 1 << 20
    by_rows, model = _verify(world, path, prefill_batch_size=5)
    assert [rows for rows, _ in model.calls] == [5, 5, 5, 5, 4]
    assert model.alive_at_call == [0] * 5  # each call's logits are gone before the next call runs
    for report in (by_bytes, by_rows):  # the same statistics, to the digit, whatever the cut
        assert [(c.name, c.status, c.detail) for c in report.checks] == [
            (c.name, c.status, c.detail) for c in whole.checks
        ]


def test_evidence_keeps_no_tensor_of_a_call(world, tmp_path: Path):
    engine, tasks, rows = world

    ctx = VerificationContext(
        write_honest(tmp_path / "f.parquet", rows), _settings(), engine, tasks, random.Random(0)
    )
    assert run_checks(default_checks(), ctx).accepted
    assert len(ctx.evidence) == len(rows) and any(e.eos_logprob is not None for e in ctx.evidence.values())
    # Numbers only: no tensor or array (no view of a prefill, nothing the size of the vocabulary) outlives its
    # call. Each leaf is read as stored (dataclasses.asdict would turn a nested tensor into a list first).
    for e in ctx.evidence.values():
        assert isinstance(e.toploc, list), e.toploc
        leaves = [
            e.eos_logprob,
            *vars(e.sampling).values(),
            *(v for chunk in e.toploc for v in vars(chunk).values()),
        ]
        assert all(v is None or isinstance(v, (int, float)) for v in leaves), [type(v) for v in leaves]


def test_evidence_reads_the_positions_a_full_prefill_gives_for_each_check(world, tmp_path: Path):
    # The verifier prefills from each prompt's last token; every statistic must be the one the full
    # prefill gives at the absolute positions: TOPLOC and the replay at committed_rows, p(EOS) at the
    # position that drew the final token. (An off-by-one at p(EOS) would stay inside its loose bound.)
    engine, tasks, rows = world
    ctx = VerificationContext(
        write_honest(tmp_path / "f.parquet", rows), _settings(), engine, tasks, random.Random(0)
    )
    assert run_checks(default_checks(), ctx).accepted
    full = engine.prefill([r.prompt_ids + r.output_ids for r in rows])
    margin = ctx.settings.sampling_thresholds().margin
    assert any(r.finish_reason == "eos" for r in rows)
    for i, (row, whole) in enumerate(zip(rows, full, strict=True)):
        span = committed_rows(len(row.prompt_ids), len(row.output_ids))
        evidence = ctx.evidence[i]
        assert evidence.toploc == check_proofs([row.proof], [whole.hidden_states[span]])[0]
        replay = replay_samplings(
            [whole.logits[span]], [row.output_ids], [row.sample_seed], row.temperature, margin
        )[0]
        assert evidence.sampling.logprob_sum == pytest.approx(replay.logprob_sum, abs=1e-4)
        assert (evidence.sampling.near_ties, evidence.sampling.mismatches) == (
            replay.near_ties,
            replay.mismatches,
        )
        if row.finish_reason == "eos":
            drew_last = len(row.prompt_ids) + len(row.output_ids) - 2
            expected = eos_logprob(whole.logits[drew_last], engine.eos_token_id, row.temperature)
            assert evidence.eos_logprob == pytest.approx(expected, abs=1e-5)
            assert (
                abs(eos_logprob(whole.logits[drew_last + 1], engine.eos_token_id, row.temperature) - expected)
                > 1e-3
            )
        else:
            assert evidence.eos_logprob is None


def test_forged_proofs_are_rejected_after_one_prefill_call(world, tmp_path: Path):
    # Proofs of the right length but made of nothing cost a node no compute; they must not cost the
    # validator a prefill of every row either.
    rows = [dataclasses.replace(r, proof=bytes(len(r.proof))) for r in world[2]]
    report, model = _verify(world, write_signed(tmp_path / "forged.parquet", rows), prefill_batch_size=4)
    assert rejected_by(report) == "toploc" and len(model.calls) == 1, report.reasons
