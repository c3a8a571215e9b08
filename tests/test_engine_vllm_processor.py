"""The vLLM Gumbel logits processor's own logic, run against a stand-in of vLLM's interface types.

vLLM cannot be installed here, so this is NOT a test of the vLLM backend: it checks our bookkeeping of
vLLM's persistent batch (added / removed / moved rows, in vLLM's documented order) and that the processed
row's argmax is exactly the engine-wide Gumbel sample. The stand-in copies only the documented shapes of
`SamplingParams.extra_args`, `BatchUpdate`, `MoveDirectionality` and the `LogitsProcessor` base class.
"""

from __future__ import annotations

import enum
import importlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from prime_node.proofs.gumbel import gumbel_argmax

VOCAB = 50
MODULE = "prime_node.node.engine.vllm_gumbel"


@dataclass
class StandInSamplingParams:
    temperature: float = 0.0
    extra_args: dict[str, Any] | None = None


class StandInMove(enum.Enum):
    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


@dataclass(frozen=True)
class StandInBatchUpdate:
    batch_size: int
    removed: list[int] = field(default_factory=list)
    added: list[tuple[int, StandInSamplingParams, list[int] | None, list[int]]] = field(default_factory=list)
    moved: list[tuple[int, int, StandInMove]] = field(default_factory=list)


@pytest.fixture()
def gumbel_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = StandInSamplingParams  # type: ignore[attr-defined]
    processors = types.ModuleType("vllm.v1.sample.logits_processor")
    processors.LogitsProcessor = object  # type: ignore[attr-defined]
    processors.BatchUpdate = StandInBatchUpdate  # type: ignore[attr-defined]
    processors.MoveDirectionality = StandInMove  # type: ignore[attr-defined]
    for name, module in {
        "vllm": vllm,
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.sample": types.ModuleType("vllm.v1.sample"),
        "vllm.v1.sample.logits_processor": processors,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    yield importlib.import_module(MODULE)
    # The module bound to the stand-in must not leak into other tests.
    sys.modules.pop(MODULE, None)
    package = sys.modules[MODULE.rpartition(".")[0]]
    if hasattr(package, "vllm_gumbel"):
        delattr(package, "vllm_gumbel")


def opted_in(seed: int, temperature: float) -> StandInSamplingParams:
    return StandInSamplingParams(extra_args={"gumbel_seed": seed, "gumbel_temperature": temperature})


def expected_tokens(logits: torch.Tensor, rows: dict[int, tuple[int, float, list[int]]]) -> dict[int, int]:
    return {
        row: int(gumbel_argmax(logits[row], temperature, torch.tensor(seed), torch.tensor(len(output))))
        for row, (seed, temperature, output) in rows.items()
    }


def test_processor_rows_follow_the_batch_and_sample_like_the_engine(gumbel_module: types.ModuleType) -> None:
    processor = gumbel_module.GumbelLogitsProcessor(None, torch.device("cpu"), False)
    outputs = {name: [7] * n for name, n in {"a": 0, "b": 2, "c": 5, "d": 1}.items()}
    processor.update_state(
        StandInBatchUpdate(
            batch_size=4,
            added=[
                (0, opted_in(11, 0.7), [5], outputs["a"]),
                (1, opted_in(22, 1.0), [5], outputs["b"]),
                (2, opted_in(33, 1.3), [5], outputs["c"]),
                (3, StandInSamplingParams(), [5], outputs["d"]),  # not opted in: left untouched
            ],
        )
    )
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    processed = processor.apply(logits.clone())
    want = expected_tokens(
        logits, {0: (11, 0.7, outputs["a"]), 1: (22, 1.0, outputs["b"]), 2: (33, 1.3, outputs["c"])}
    )
    assert {row: int(processed[row].argmax()) for row in want} == want
    assert torch.equal(processed[3], logits[3])

    # A token arrives for "a" (live list), "b" leaves, "c" and "a" swap rows, "d" moves onto row 1.
    outputs["a"].append(9)
    processor.update_state(
        StandInBatchUpdate(
            batch_size=3, removed=[1], moved=[(0, 2, StandInMove.SWAP), (3, 1, StandInMove.UNIDIRECTIONAL)]
        )
    )
    processed = processor.apply(logits.clone())
    want = expected_tokens(logits, {2: (11, 0.7, outputs["a"]), 0: (33, 1.3, outputs["c"])})
    assert {row: int(processed[row].argmax()) for row in want} == want
    assert torch.equal(processed[1], logits[1]) and set(processor.rows) == {0, 2}


def test_processor_refuses_bad_request_arguments(gumbel_module: types.ModuleType) -> None:
    validate = gumbel_module.GumbelLogitsProcessor.validate_params
    validate(StandInSamplingParams())  # not opted in: nothing to check
    validate(opted_in(5, 1.0))
    for bad, message in [
        (opted_in(-1, 1.0), "gumbel_seed"),
        (opted_in(2**63, 1.0), "gumbel_seed"),
        (opted_in(5, 0.0), "gumbel_temperature"),
        (
            StandInSamplingParams(temperature=1.0, extra_args={"gumbel_seed": 5, "gumbel_temperature": 1.0}),
            "greedy",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            validate(bad)
