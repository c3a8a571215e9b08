"""Pipelined generation: stage layout as a run parameter, stage-only weight loading, and token-for-token (and
log-probability-for-log-probability) identity with a monolithic node in 2 and 4 stages (float32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from prime_node.node.engine.hf import HFEngine
from prime_node.node.engine.types import SamplingParams
from prime_node.node.errors import EngineError
from prime_node.node.pipeline.driver import run_loopback
from prime_node.node.pipeline.stage_model import StageModel
from prime_node.node.pipeline.weights import load_stage_tensors
from prime_node.node.run.announcement import differences, run_parameters
from prime_node.node.run.settings import RunSettings
from prime_node.p2p.pipeline.layout import StageLayout

from support.pipeline import frequent_token, group, random_requests, save_tiny

PARAMS = SamplingParams(max_new_tokens=16, temperature=1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-pipeline"))


def test_layout_is_a_pinned_run_parameter() -> None:
    ours = run_parameters(RunSettings(pipeline={"boundaries": [0, 2, 4]}))
    theirs = run_parameters(RunSettings(pipeline={"boundaries": [0, 1, 4]}))
    assert ours.pipeline == StageLayout(boundaries=[0, 2, 4])
    (line,) = differences(ours, theirs)
    assert line == "run.pipeline.boundaries: [0, 2, 4] here, [0, 1, 4] in the run"  # the field, both values
    assert differences(ours, run_parameters(RunSettings())) != []  # pipelined vs not is a mismatch too


@pytest.mark.parametrize("boundaries", [[0, 4], [1, 2, 4], [0, 3, 3, 4], [0, 4, 2], [0, 2, 5000]], ids=str)
def test_bad_layouts_are_refused(boundaries: list[int]) -> None:
    with pytest.raises(ValidationError):
        StageLayout(boundaries=boundaries)


def test_a_run_whose_group_batches_carry_too_many_output_tokens_is_refused() -> None:
    """Every end frame carries prompts x samples x max_new_tokens int64 tokens, and every stage holds them as
    Python ints: a run past MAX_PIPELINE_COMPLETION_ENTRIES is refused when configured (a run without
    pipelined groups, or at the bound, is not)."""
    layout = StageLayout(boundaries=[0, 2, 4], prompts=512, micro_batch_size=8)
    RunSettings(run_id="big", samples=8, max_new_tokens=1024, pipeline=layout)  # 2^22: at the bound
    RunSettings(run_id="big", samples=16, max_new_tokens=8192)  # no pipeline: no end frames
    with pytest.raises(ValidationError, match="output tokens per group batch"):
        RunSettings(run_id="big", samples=16, max_new_tokens=1024, pipeline=layout)


def test_layout_must_cover_the_model(model_dir: Path) -> None:
    with pytest.raises(EngineError, match="model has 4 layers"):
        StageModel.load(model_dir, StageLayout(boundaries=[0, 2, 3]), 0)


def test_a_stage_reads_only_its_own_tensors(model_dir: Path) -> None:
    import torch

    layout = StageLayout(boundaries=[0, 1, 3, 4])
    first, middle, last = (
        load_stage_tensors(model_dir, layout, s, torch.float32, tied=True) for s in range(3)
    )
    assert "embed.weight" in first and "head.weight" not in first
    assert {name.split(".")[1] for name in first if name.startswith("layers.")} == {"0"}
    assert {name.split(".")[1] for name in middle if name.startswith("layers.")} == {"0", "1"}
    assert not any(name in middle for name in ("embed.weight", "norm.weight", "head.weight"))
    assert "norm.weight" in last and "head.weight" in last and "embed.weight" not in last
    # Renumbered from 0 within the stage: stage 1's layer 0 is the checkpoint's layer 1.
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="pt") as handle:
        expected = handle.get_tensor("model.layers.1.mlp.up_proj.weight")
    assert torch.equal(middle["layers.0.mlp.up_proj.weight"], expected)


@pytest.mark.parametrize("boundaries", [[0, 2, 4], [0, 1, 2, 3, 4]], ids=["2-stage", "4-stage"])
@pytest.mark.parametrize("micro_batch_size", [3, 16])
def test_pipelined_generation_is_identical_to_monolithic(
    model_dir: Path, boundaries: list[int], micro_batch_size: int, one_torch_thread: None
) -> None:
    requests = random_requests(7, seed=len(boundaries) + micro_batch_size)
    reference_engine = HFEngine.load(model_dir, dtype="float32", max_batch_size=micro_batch_size)
    # An EOS the model emits often, so that samples finish at different steps and leave the batch (the
    # cache row selection is exercised on every stage).
    eos = frequent_token(reference_engine, requests, PARAMS)
    engine = HFEngine(reference_engine.model, eos_token_id=eos, max_batch_size=micro_batch_size)
    reference = engine.generate(requests, PARAMS, capture_hidden=False)
    assert {c.finish_reason for c in reference} == {"eos", "length"}
    spec, processors, ids = group(
        model_dir,
        boundaries,
        requests,
        PARAMS,
        micro_batch_size=micro_batch_size,
        eos_token_id=eos,
        pad_token_id=engine.pad_token_id,
    )
    completions, records = run_loopback(spec, processors, ids)
    for ours, theirs in zip(completions, reference, strict=True):
        assert ours.output_ids == theirs.output_ids
        assert ours.output_logprobs == theirs.output_logprobs  # bit-identical float32 compute
        assert ours.finish_reason == theirs.finish_reason
    assert all(r.is_authentic() for r in records)
    assert [r.record.stage for r in records] == list(range(len(boundaries) - 1))


def test_a_stage_needs_only_the_shards_of_its_tensors(model_dir: Path, tmp_path: Path) -> None:
    """With only its shards' bytes present (every other byte of the checkpoint zeroed), a stage loads exactly
    what it loads from the whole checkpoint; the middle stages need a fraction of the shards."""
    import shutil

    import torch

    from prime_node.node.pipeline.weights import stage_shards

    names = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    files = [(name, (model_dir / name).stat().st_size) for name in names]
    blob = b"".join((model_dir / name).read_bytes() for name in names)
    shard_size = 16 << 10
    total_shards = -(-len(blob) // shard_size)
    headers = {"model.safetensors": (model_dir / "model.safetensors").read_bytes()[: 1 << 16]}
    layout = StageLayout(boundaries=[0, 1, 2, 3, 4])
    counts = []
    for stage in range(layout.stages):
        shards = stage_shards(files, shard_size, headers, layout, stage, tied=True)
        counts.append(len(shards))
        sparse = bytearray(len(blob))
        for i in shards:
            sparse[i * shard_size : (i + 1) * shard_size] = blob[i * shard_size : (i + 1) * shard_size]
        out = tmp_path / f"stage{stage}"
        out.mkdir()
        offset = 0
        for name, size in files:
            (out / name).write_bytes(bytes(sparse[offset : offset + size]))
            offset += size
        full = load_stage_tensors(model_dir, layout, stage, torch.float32, tied=True)
        partial = load_stage_tensors(out, layout, stage, torch.float32, tied=True)
        assert full.keys() == partial.keys()
        assert all(torch.equal(full[k], partial[k]) for k in full)
        shutil.rmtree(out)
    assert counts[1] < total_shards / 2 and counts[2] < total_shards / 2, (counts, total_shards)


def test_the_layout_loads_from_a_config_file_and_the_environment(tmp_path: Path) -> None:
    from prime_node.node.config import load_config
    from prime_node.node.errors import ConfigError
    from prime_node.node.run.settings import RolloutSettings

    toml = tmp_path / "node.toml"
    toml.write_text('[run]\npipeline = {boundaries = [0, 1, 4], activation_dtype = "bfloat16"}\n')
    from_file = load_config(RolloutSettings, toml_path=toml, env={})
    assert from_file.run.pipeline == StageLayout(boundaries=[0, 1, 4], activation_dtype="bfloat16")
    from_env = load_config(RolloutSettings, env={"PRIME_NODE_RUN__PIPELINE": '{"boundaries": [0, 2, 4]}'})
    assert from_env.run.pipeline == StageLayout(boundaries=[0, 2, 4])
    with pytest.raises(ConfigError, match="pipeline"):
        load_config(RolloutSettings, env={"PRIME_NODE_RUN__PIPELINE": '{"boundaries": [0, 4]}'})
