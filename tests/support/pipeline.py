"""A tiny model saved to disk and pipelined groups over it, shared by the pipeline tests and
benchmarks/pipeline.py."""

from __future__ import annotations

import random
from pathlib import Path

from prime_node.node.engine.hf import HFEngine
from prime_node.node.engine.types import SampleRequest, SamplingParams
from prime_node.node.models.tiny import TinyModelShape, build_tiny_model, save_model_dir
from prime_node.node.pipeline.stage import StageProcessor
from prime_node.node.pipeline.stage_model import StageModel
from prime_node.node.pipeline.work import PipelineWork
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.proofs.pipeline.records import GroupSpec


def save_tiny(out: Path, seed: int = 3, shape: TinyModelShape | None = None) -> Path:
    save_model_dir(*build_tiny_model(seed=seed, shape=shape), out)
    return out


def random_requests(count: int, seed: int, vocab: int = 250) -> tuple[SampleRequest, ...]:
    rng = random.Random(seed)
    return tuple(
        SampleRequest(
            tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(2, 14))), rng.randrange(2**40)
        )
        for _ in range(count)
    )


def identities(stages: int, salt: int = 0) -> list[Identity]:
    return [Identity.from_seed(bytes([salt + s + 1]) * 32) for s in range(stages)]


def group(
    model_dir: Path,
    boundaries: list[int],
    requests: tuple[SampleRequest, ...],
    params: SamplingParams,
    *,
    micro_batch_size: int,
    eos_token_id: int,
    pad_token_id: int,
    batch: int = 0,
    commit: bool = True,
) -> tuple[GroupSpec, list[StageProcessor], list[Identity]]:
    layout = StageLayout(boundaries=boundaries)
    work = PipelineWork(requests, params, micro_batch_size, eos_token_id, pad_token_id)
    processors = [
        StageProcessor(StageModel.load(model_dir, layout, s), work, commit=commit)
        for s in range(layout.stages)
    ]
    ids = identities(layout.stages)
    spec = GroupSpec("local", 0, batch, layout, tuple(i.node_id for i in ids))
    return spec, processors, ids


def frequent_token(engine: HFEngine, requests: tuple[SampleRequest, ...], params: SamplingParams) -> int:
    """A token the model emits often: used as EOS so that samples finish early and leave the batch."""
    counts: dict[int, int] = {}
    for completion in engine.generate(requests, params, capture_hidden=False):
        for token in completion.output_ids[1:6]:
            counts[token] = counts.get(token, 0) + 1
    return max(counts, key=lambda t: counts[t])
