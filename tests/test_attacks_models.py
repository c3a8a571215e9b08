"""Cheating nodes that run other weights or another sampler, caught with the real tiny model.

Each cheater generates for real (other weights, int4 weights, greedy or colder sampling, a smaller
model whose tokens get proofs from the claimed model) and signs a well-formed file; the verifier must
reject it with the check that names the cheat.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from prime_node.node.models.tiny import TinyModelShape, build_tiny_model

from support.attack import (
    SPEC,
    build_world,
    engine_from,
    honest_rows,
    perturbed_engine,
    quantized_engine,
    rejected_by,
    reprove,
    sampled_rows,
    verify,
    write_signed,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("ckpt"))


def _verdict(world, tmp_path: Path, rows) -> tuple[str | None, list[str]]:
    engine, tasks, _ = world
    report = verify(write_signed(tmp_path / "cheat.parquet", rows), engine, tasks)
    return rejected_by(report), report.reasons


@pytest.mark.parametrize(
    "make_engine",
    [
        pytest.param(lambda: engine_from(build_tiny_model(1)[0]), id="other-seed"),
        pytest.param(lambda: perturbed_engine(5e-2), id="layer-noise-5e-2"),
        pytest.param(lambda: quantized_engine(4), id="int4"),
    ],
)
def test_other_weights_fail_toploc(world, tmp_path: Path, make_engine):
    _, tasks, _ = world
    cheat = honest_rows(make_engine(), tasks)
    name, reasons = _verdict(world, tmp_path, cheat)
    assert name == "toploc", reasons


def test_prompt_changed_before_generation_fails_toploc(world, tmp_path: Path):
    engine, tasks, rows = world
    # Generate from an edited prompt but claim the assigned one: the proofs belong to another input.
    cheat_engine = engine_from(build_tiny_model(0)[0])
    edited = [dataclasses.replace(r, prompt_ids=(r.prompt_ids[0] + 1,) + r.prompt_ids[1:]) for r in rows]
    generated = sampled_rows(cheat_engine, tasks, edited, SPEC.temperature)
    proven = [reprove(cheat_engine, r) for r in generated]
    claimed = [dataclasses.replace(p, prompt_ids=r.prompt_ids) for p, r in zip(proven, rows)]
    name, reasons = _verdict(world, tmp_path, claimed)
    assert name == "toploc", reasons


def test_greedy_and_colder_sampling_fail_sampling(world, tmp_path: Path):
    engine, tasks, rows = world
    greedy = sampled_rows(engine, tasks, rows, 1e-4)  # logits / 1e-4 dwarf the noise: greedy decoding
    name, reasons = _verdict(world, tmp_path, [reprove(engine, r) for r in greedy])
    assert name == "sampling", reasons
    cold = sampled_rows(engine, tasks, rows, 0.5)  # the seeded noise, another temperature
    name, reasons = _verdict(world, tmp_path, [reprove(engine, r) for r in cold])
    assert name == "sampling", reasons


def test_smaller_model_tokens_with_claimed_model_proofs(world, tmp_path: Path):
    engine, tasks, rows = world
    small, _ = build_tiny_model(3, TinyModelShape(num_hidden_layers=1, intermediate_size=128))
    # The same seeded sampler on a cheaper model, then proofs honestly computed by the claimed one.
    cheap = sampled_rows(engine_from(small), tasks, rows, 1.0)
    name, reasons = _verdict(world, tmp_path, [reprove(engine, r) for r in cheap])  # proofs by the real one
    assert name == "sampling", reasons
