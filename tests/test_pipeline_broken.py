"""Blame in a batch that broke mid-way (proofs/pipeline/broken.py): a stage that drops a row breaks the batch
(stage 0 refuses tokens of other rows than it fed); from the members' partial records the validator names the
stage that dropped it, judged on its own record, and never an honest one, even one that hands in nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from prime_node.node.engine.hf import HFEngine
from prime_node.node.engine.types import SamplingParams
from prime_node.node.pipeline.driver import run_loopback
from prime_node.node.pipeline.errors import BatchBroken
from prime_node.proofs.pipeline.broken import BatchRules, blame_broken, cut_of

from support.pipeline import group, identities, random_requests, save_tiny
from support.pipeline_attacks import rechain
from support.pipeline_files import drop_a_row

PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0)
BOUNDARIES = [0, 1, 3, 4]  # three stages: a relay stage in the middle


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-pipeline-broken"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> HFEngine:
    return HFEngine.load(model_dir, dtype="float32")


def _broken(model_dir: Path, engine: HFEngine, tamper) -> tuple:  # noqa: ANN001
    requests = random_requests(4, seed=11)
    spec, processors, ids = group(
        model_dir,
        BOUNDARIES,
        requests,
        PARAMS,
        micro_batch_size=4,
        eos_token_id=engine.eos_token_id,
        pad_token_id=engine.pad_token_id,
    )
    work = BatchRules(engine.eos_token_id, PARAMS.max_new_tokens, cut_of([r.prompt_ids for r in requests], 4))
    with pytest.raises(BatchBroken) as broken:
        run_loopback(spec, processors, ids, tamper=tamper)
    return spec, work, broken.value.partial


@pytest.mark.parametrize(
    ("stage", "kind", "step"),
    [(1, "decode", 1), (2, "tokens", 1), (0, "decode", 1), (1, "prefill", 0)],
    ids=["relay-decode", "last-tokens", "first-decode", "relay-prefill"],
)
def test_the_stage_that_dropped_a_row_is_named(
    model_dir: Path, engine: HFEngine, stage: int, kind: str, step: int, one_torch_thread: None
) -> None:
    spec, work, partial = _broken(model_dir, engine, drop_a_row(stage, kind, step))
    verdict = blame_broken(spec, partial, work)
    assert verdict.blamed == stage, verdict.reason
    assert "carries rows" in verdict.reason
    # A culprit that withholds its record is not judged (its input would rest on its predecessor's word alone),
    # and with fewer records no honest stage is ever blamed.
    for missing in range(3):
        thin = [None if k in (stage, missing) else r for k, r in enumerate(partial)]
        assert blame_broken(spec, thin, work).blamed is None
    without_witness = [None if k == (stage + 1) % 3 and stage != 0 else r for k, r in enumerate(partial)]
    if stage == 1:  # its output is also in its own record: blamed without its successor's copy
        assert blame_broken(spec, without_witness, work).blamed == stage


def test_a_stage_that_hands_in_nothing_cannot_be_framed(
    model_dir: Path, engine: HFEngine, one_torch_thread: None
) -> None:
    """Stage 1 drops a row. The last stage then signs a tokens stream whose token, for a row stage 0 fed on,
    is EOS (its own outputs say so): judged on that stream alone, stage 0 would have fed a finished sample.
    Stage 0 hands in nothing: it is not judged, and stage 1 is still named."""
    spec, work, partial = _broken(model_dir, engine, drop_a_row(1, "decode", 1))
    record = partial[2].record
    outputs = [list(o) for o in record.outputs]
    headers = list(record.sent.headers)
    at = next(i for i, h in enumerate(headers) if h.kind == "tokens" and h.step == 0)
    row = headers[at].rows[0]
    outputs[row][0] = work.eos_token_id
    tokens = np.array([outputs[r][0] for r in headers[at].rows], dtype="<i8").tobytes()
    headers[at] = headers[at].model_copy(update={"tensor_sha256": hashlib.sha256(tokens).hexdigest()})
    lie = rechain(record.sent.model_copy(update={"headers": headers}), ids_of(spec)[2])
    framing = partial[2].model_copy(
        update={"record": record.model_copy(update={"sent": lie, "outputs": outputs})}
    )
    verdict = blame_broken(spec, [None, partial[1], framing], work)
    assert verdict.blamed == 1, verdict.reason


def test_a_forged_copy_and_an_equivocation_are_named(
    model_dir: Path, engine: HFEngine, one_torch_thread: None
) -> None:
    spec, work, partial = _broken(model_dir, engine, drop_a_row(1, "decode", 1))
    # Stage 2 claims stage 1 sent it other headers: its copy is not signed by 1, so stage 2 forged it.
    record = partial[2].record
    headers = [h.model_copy(update={"rows": h.rows[:1]}) for h in record.received.headers]
    forged = record.model_copy(update={"received": record.received.model_copy(update={"headers": headers})})
    verdict = blame_broken(
        spec, [partial[0], partial[1], partial[2].model_copy(update={"record": forged})], work
    )
    assert verdict.blamed == 2 and "not signed by 1" in verdict.reason, verdict.reason
    # Stage 1's own record shows another stream than the one stage 2 holds, both signed by 1: equivocation.
    sent = partial[1].record.sent
    other = rechain(sent.model_copy(update={"headers": headers}), ids_of(spec)[1])
    lying = partial[1].record.model_copy(update={"sent": other})
    verdict = blame_broken(
        spec, [partial[0], partial[1].model_copy(update={"record": lying}), partial[2]], work
    )
    assert verdict.blamed == 1 and "two different streams" in verdict.reason, verdict.reason


def ids_of(spec):  # noqa: ANN001, ANN201
    """The identities support.pipeline.group signs with (identities(stages)), checked against the spec."""
    ids = identities(spec.layout.stages)
    assert tuple(i.node_id for i in ids) == spec.members
    return ids
