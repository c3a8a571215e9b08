"""Blame assignment for pipelined groups: every adversary kind at every stage is named, no honest stage is
blamed, honest batches verify; over TCP, a frame whose commitment its tensor belies dissolves the group with
evidence that blames its sender, and a stage dropping out mid-batch leaves no stage record to accept.

The slow test runs >= 100 injected faults and >= 500 honest pipelined rollouts (the issue's counts)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from prime_node.node.engine.hf import HFEngine
from prime_node.node.engine.types import SamplingParams
from prime_node.node.pipeline.boundaries import BoundaryOracle
from prime_node.node.pipeline.group import HopSettings, StageRunner, run_group
from prime_node.node.pipeline.stage import Outgoing
from prime_node.p2p.pipeline.errors import PipelineWireError
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.proofs.pipeline.blame import GroupWork, check_fraud

from support.pipeline import group, identities, random_requests, regroup_after_a_kill, save_tiny
from support.pipeline_attacks import Fault, faults_for, run_case

PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-pipeline-blame"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> HFEngine:
    return HFEngine.load(model_dir, dtype="float32")


def verdicts(model_dir: Path, engine: HFEngine, boundaries: list[int], faults: list[Fault | None], seed: int):  # type: ignore[no-untyped-def]
    oracle = BoundaryOracle(engine.model, StageLayout(boundaries=boundaries))
    requests = random_requests(4, seed)
    for fault in faults:
        yield (
            fault,
            run_case(
                model_dir,
                boundaries,
                requests,
                PARAMS,
                oracle,
                eos_token_id=engine.eos_token_id,
                pad_token_id=engine.pad_token_id,
                fault=fault,
            ),
        )


@pytest.mark.parametrize("boundaries", [[0, 2, 4], [0, 1, 2, 3, 4]], ids=["2-stage", "4-stage"])
def test_every_fault_is_pinned_on_its_stage(
    model_dir: Path, engine: HFEngine, boundaries: list[int], one_torch_thread: None
) -> None:
    faults: list[Fault | None] = [None, *faults_for(len(boundaries) - 1)]
    for fault, verdict in verdicts(model_dir, engine, boundaries, faults, seed=5):
        expected = None if fault is None else fault.stage
        assert verdict.blamed == expected, f"{fault}: {verdict.reason}"


@pytest.fixture
def tcp_group(model_dir: Path, engine: HFEngine):  # type: ignore[no-untyped-def]
    requests = random_requests(4, 9)
    return group(
        model_dir,
        [0, 1, 3, 4],
        requests,
        PARAMS,
        micro_batch_size=2,
        eos_token_id=engine.eos_token_id,
        pad_token_id=engine.pad_token_id,
    ), requests


def test_over_tcp_a_belied_commitment_dissolves_the_group_and_blames_its_sender(
    tcp_group, engine: HFEngine, one_torch_thread: None
) -> None:
    (spec, processors, ids), requests = tcp_group

    def corrupt(stage: int, out: Outgoing) -> Outgoing:
        if stage == 1 and out.kind == "decode" and out.step == 2:
            return dataclasses.replace(out, tensor=out.tensor * 1.01)
        return out

    runners: list[StageRunner] = []
    with pytest.raises(ExceptionGroup):
        asyncio.run(
            run_group(spec, processors, ids, HopSettings(frame_timeout_s=10), tamper=corrupt, runners=runners)
        )
    (evidence,) = [r.fraud for r in runners if r.fraud is not None]
    work = GroupWork(
        [r.prompt_ids for r in requests],
        [r.seed for r in requests],
        1.0,
        PARAMS.max_new_tokens,
        engine.eos_token_id,
        2,
    )
    verdict = check_fraud(spec, evidence, work)
    assert verdict.blamed == 1, verdict.reason
    # The same evidence with the tensor the sender committed to proves nothing against it.
    honest = dataclasses.replace(evidence, tensor=b"\x00" * len(evidence.tensor))
    assert check_fraud(spec, honest, work).blamed is None


def test_over_tcp_a_frame_wider_than_the_schedule_is_refused_before_its_tensor_is_read(
    tcp_group, one_torch_thread: None
) -> None:
    (spec, processors, ids), _ = tcp_group

    def widen(stage: int, out: Outgoing) -> Outgoing:  # a prefill padded far beyond the micro-batch's prompts
        if stage == 0 and out.kind == "prefill":
            rows, width, hidden = out.tensor.shape
            return dataclasses.replace(out, tensor=out.tensor.new_zeros(rows, width + 1024, hidden))
        return out

    with pytest.raises(ExceptionGroup) as failure:
        asyncio.run(run_group(spec, processors, ids, HopSettings(frame_timeout_s=10), tamper=widen))
    # The receiver's reader names the schedule, from the header alone; stage 1's own check of a tensor it had
    # read ("is not the batch's") is never reached.
    assert failure.group_contains(
        PipelineWireError, match="prefill frame declared as .* the schedule calls for"
    )


def test_a_stage_dropping_out_mid_batch_dissolves_the_group(tcp_group, one_torch_thread: None) -> None:
    (spec, processors, ids), _ = tcp_group

    def crash(stage: int, out: Outgoing) -> Outgoing:
        if stage == 2 and out.step == 3:
            raise ConnectionResetError("stage 2 went away")
        return out

    runners: list[StageRunner] = []
    with pytest.raises(ExceptionGroup) as failure:
        asyncio.run(
            run_group(spec, processors, ids, HopSettings(frame_timeout_s=10), tamper=crash, runners=runners)
        )
    assert failure.group_contains(ConnectionResetError)
    # No stage finished its batch, so none has an "end"-terminated stream to put in a record.
    assert all(not r.writer.headers or r.writer.headers[-1].kind != "end" for r in runners)


def test_survivors_regroup_without_the_dead_stage_and_their_work_verifies(
    model_dir: Path, engine: HFEngine, one_torch_thread: None
) -> None:
    pool = identities(4, salt=40)
    seconds, verdict, dead, members = regroup_after_a_kill(model_dir, engine, PARAMS, pool)
    assert dead not in members and len(set(members)) == 2
    assert verdict.accepted, verdict.reason
    assert seconds > 0


@pytest.mark.slow
def test_blame_over_many_faults_and_honest_rollouts(
    model_dir: Path, engine: HFEngine, one_torch_thread: None
) -> None:
    """>= 100 injected faults (every kind, every stage, 2 and 4 stages) and >= 500 honest rollouts."""
    faults = honest = 0
    for layout in ([0, 2, 4], [0, 1, 2, 3, 4], [0, 1, 3, 4]):
        stages = len(layout) - 1
        for seed in range(3):
            cases: list[Fault | None] = [
                None,
                *(dataclasses.replace(f, seed=seed) for f in faults_for(stages)),
            ]
            for fault, verdict in verdicts(model_dir, engine, layout, cases, seed=100 + seed):
                if fault is None:
                    assert verdict.accepted, verdict.reason
                    honest += 4
                else:
                    assert verdict.blamed == fault.stage, f"{fault}: {verdict.reason}"
                    faults += 1
    for seed in range(120):  # more honest batches, 4 rollouts each
        layout = [[0, 2, 4], [0, 1, 2, 3, 4]][seed % 2]
        ((_, verdict),) = verdicts(model_dir, engine, layout, [None], seed=1000 + seed)
        assert verdict.accepted, verdict.reason
        honest += 4
    assert faults >= 100 and honest >= 500
