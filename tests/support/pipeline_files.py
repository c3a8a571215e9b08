"""A pipelined group's batch run over a real checkpoint and written as each member's signed stage file: shared by
the stage-file tests and the validator service's group tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from prime_node.node.engine import HFEngine
from prime_node.node.pipeline.driver import Tamper, run_loopback
from prime_node.node.pipeline.errors import BatchBroken, FraudDetected
from prime_node.node.pipeline.rollouts import write_member_file, write_member_partial, write_member_report
from prime_node.node.pipeline.stage import Outgoing, StageProcessor
from prime_node.node.pipeline.stage_model import StageModel
from prime_node.node.pipeline.work import GroupBatch, work_for
from prime_node.node.run.settings import RunSettings
from prime_node.node.run.validation import RunTasks
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.proofs.pipeline.records import GroupSpec
from prime_node.proofs.toploc import build_proof

from support.nonces import NONCE


@dataclass(frozen=True)
class GroupFiles:
    spec: GroupSpec
    batch: GroupBatch
    paths: list[Path]  # one stage file per stage, in stage order (its envelope beside it)


def group_files(
    out: Path,
    checkpoint: Path,
    run: RunSettings,
    tasks: RunTasks,
    engine: HFEngine,
    members: list[Identity],
    *,
    batch: int = 0,
    step: int = 0,
    prompts: int | None = None,
    micro_batch_size: int | None = None,
    tamper: Tamper | None = None,
    corrupt: Callable[[list[StageProcessor]], None] | None = None,
    nonce: str = NONCE,
) -> GroupFiles:
    """Run batch `batch` of the group of `members` (layout `run.pipeline`, whose batch shape it takes unless
    `prompts` or `micro_batch_size` say otherwise) in one process, the assignment from `work_for`, and write
    every member's stage file into `out`; `tamper` and `corrupt` inject faults (the adversaries of
    tests/support/pipeline_attacks.py)."""
    assert run.pipeline is not None
    layout: StageLayout = run.pipeline
    spec = GroupSpec(run.run_id, step, batch, layout, tuple(m.node_id for m in members), nonce)
    group_batch = _batch(run.pipeline, spec.group_id, step, batch, prompts, micro_batch_size)
    work, assignment = work_for(
        run, tasks, group_batch, eos_token_id=engine.eos_token_id, pad_token_id=engine.pad_token_id
    )
    processors = [StageProcessor(StageModel.load(checkpoint, layout, s), work) for s in range(layout.stages)]
    if corrupt is not None:
        corrupt(processors)
    _, records = run_loopback(spec, processors, members, tamper=tamper)
    paths = []
    for k, (member, record) in enumerate(zip(members, records, strict=True)):
        path = out / f"group-{spec.group_id[:8]}-b{batch}-stage{k}.parquet"
        last = k == layout.stages - 1
        write_member_file(
            path,
            run,
            tasks,
            group_batch,
            work,
            assignment,
            spec.members,
            spec.layout,
            spec.nonce,
            record,
            member,
            processors[k].final_states() if last else None,
        )
        paths.append(path)
    return GroupFiles(spec, group_batch, paths)


def _batch(
    layout: StageLayout,
    group_id: str,
    step: int,
    batch: int,
    prompts: int | None,
    micro_batch_size: int | None,
) -> GroupBatch:
    """The batch in the run's pinned shape (`layout`), or another where a test asks for one (a member that
    does not follow the run)."""
    pinned = GroupBatch.pinned(layout, group_id, step, batch)
    return dataclasses.replace(
        pinned,
        prompts=pinned.prompts if prompts is None else prompts,
        micro_batch_size=pinned.micro_batch_size if micro_batch_size is None else micro_batch_size,
    )


def uncommitted(stage: int, seed: int = 0) -> Tamper:
    """Stage `stage` sends its first prefill with noise added to the tensor while the frame keeps the honest
    commitment (the "send-uncommitted" adversary of support/pipeline_attacks.py): its receiver finds the frame's
    tensor belying the signed commitment."""

    def tamper(sender: int, out: Outgoing) -> Outgoing:
        if sender != stage or out.kind != "prefill" or out.micro_batch != 0:
            return out
        noise = torch.randn(out.tensor.shape, generator=torch.Generator().manual_seed(seed))
        return dataclasses.replace(out, tensor=out.tensor + 0.05 * out.tensor.std() * noise)

    return tamper


def fraud_report_file(
    out: Path,
    checkpoint: Path,
    run: RunSettings,
    tasks: RunTasks,
    engine: HFEngine,
    members: list[Identity],
    *,
    cheat: int = 0,
    batch: int = 0,
    prompts: int | None = None,
    micro_batch_size: int | None = None,
    nonce: str = NONCE,
) -> tuple[GroupSpec, Path]:
    """Run a batch whose stage `cheat` sends a frame its commitment belies; the receiver's signed fraud report."""
    assert run.pipeline is not None
    spec = GroupSpec(run.run_id, 0, batch, run.pipeline, tuple(m.node_id for m in members), nonce)
    group_batch = _batch(run.pipeline, spec.group_id, 0, batch, prompts, micro_batch_size)
    work, _ = work_for(
        run, tasks, group_batch, eos_token_id=engine.eos_token_id, pad_token_id=engine.pad_token_id
    )
    processors = [
        StageProcessor(StageModel.load(checkpoint, run.pipeline, s), work) for s in range(run.pipeline.stages)
    ]
    try:
        run_loopback(spec, processors, members, tamper=uncommitted(cheat))
    except FraudDetected as detected:
        receiver = members[(cheat + 1) % len(members)]
        path = out / f"group-{spec.group_id[:8]}-b{batch}-fraud.json"
        write_member_report(
            path, run, group_batch, spec.members, spec.layout, spec.nonce, detected.fraud, receiver
        )
        return spec, path
    raise AssertionError("the receiver did not detect the frame its commitment belies")


def drop_a_row(stage: int, kind: str, step: int) -> Tamper:
    """Stage `stage` leaves the last row out of its `kind` frame of `step` (micro-batch 0), the commitment made to
    match what it sends (so no commitment check catches it: only the rows do); the batch breaks when stage 0
    gets the tokens of other rows than it fed."""

    def tamper(sender: int, out: Outgoing) -> Outgoing:
        if (
            sender != stage
            or out.kind != kind
            or out.step != step
            or out.micro_batch != 0
            or len(out.rows) < 2
        ):
            return out
        tensor = out.tensor[:-1]
        commitment = out.commitment if kind == "tokens" else build_proof(tensor[:, -1])
        return dataclasses.replace(out, rows=out.rows[:-1], tensor=tensor, commitment=commitment)

    return tamper


def partial_report_files(
    out: Path,
    checkpoint: Path,
    run: RunSettings,
    tasks: RunTasks,
    engine: HFEngine,
    members: list[Identity],
    tamper: Tamper,
    *,
    batch: int = 0,
    prompts: int | None = None,
    micro_batch_size: int | None = None,
    nonce: str = NONCE,
) -> tuple[GroupSpec, list[Path]]:
    """Run a batch that `tamper` breaks; every member's signed partial report, in stage order."""
    assert run.pipeline is not None
    spec = GroupSpec(run.run_id, 0, batch, run.pipeline, tuple(m.node_id for m in members), nonce)
    group_batch = _batch(run.pipeline, spec.group_id, 0, batch, prompts, micro_batch_size)
    work, _ = work_for(
        run, tasks, group_batch, eos_token_id=engine.eos_token_id, pad_token_id=engine.pad_token_id
    )
    processors = [
        StageProcessor(StageModel.load(checkpoint, run.pipeline, s), work) for s in range(run.pipeline.stages)
    ]
    try:
        run_loopback(spec, processors, members, tamper=tamper)
    except BatchBroken as broken:
        paths = []
        for k, (member, record) in enumerate(zip(members, broken.partial, strict=True)):
            path = out / f"group-{spec.group_id[:8]}-b{batch}-partial{k}.json"
            write_member_partial(
                path, run, group_batch, spec.members, spec.layout, spec.nonce, record, member
            )
            paths.append(path)
        return spec, paths
    raise AssertionError("the batch did not break")
