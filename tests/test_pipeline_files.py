"""Pipeline stage files (prime-node/rollout/v4): the group's assignment, what every member writes, and a reader
that refuses every malformed stage column with an error naming it."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from prime_node.node.engine import HFEngine
from prime_node.node.models.tiny import build_tiny_model
from prime_node.node.pipeline.work import GroupBatch, work_for
from prime_node.node.run.settings import RunSettings
from prime_node.node.run.validation import RunTasks
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout, layout_digest
from prime_node.proofs.assignment import assign
from prime_node.proofs.pipeline.stage_file import STAGE_SCHEMA, read_stage_file
from prime_node.proofs.rollout_file import read_rollout_file, sign_bytes, signature_path
from prime_node.proofs.rollout_schema import RolloutFileError
from prime_node.proofs.toploc import check_proof

from support.attack import engine_from, make_checkpoint, run_tasks
from support.pipeline import identities
from support.pipeline_files import GroupFiles, fraud_report_file, group_files

RUN = RunSettings(
    run_id="stage-files",
    run_seed=5,
    samples=2,
    max_new_tokens=8,
    pipeline=StageLayout(boundaries=[0, 2, 4], prompts=2, micro_batch_size=1),
)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[GroupFiles, RunTasks, HFEngine, list[Identity]]:
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")
    tasks, engine, members = (
        run_tasks(checkpoint),
        engine_from(build_tiny_model(0)[0]),
        identities(2, salt=40),
    )
    files = group_files(tmp_path_factory.mktemp("files"), checkpoint, RUN, tasks, engine, members)
    return files, tasks, engine, members


def test_every_stage_file_holds_the_groups_assignment_and_tokens(made) -> None:  # noqa: ANN001
    files, tasks, engine, members = made
    first, last = (read_stage_file(p) for p in files.paths)
    assert [f.signer for f in (first, last)] == [m.node_id for m in members]
    assert first.group_id == last.group_id == files.spec.group_id and first.members == files.spec.members
    strip = lambda f: [(r.sample_index, r.sample_seed, r.prompt_ids, r.output_ids, r.reward) for r in f.rows]  # noqa: E731
    assert strip(first) == strip(last)
    expected = assign(
        RUN.run_seed, files.spec.group_id, 0, 0, task_count=tasks.task_count, prompts=2, samples=2, group=True
    )
    assert [(r.sample_index, r.sample_seed) for r in first.rows] == list(expected.rows())
    assert all(r.proof == b"" for r in first.rows) and all(r.proof for r in last.rows)
    assert first.record.record.sent == last.record.record.received  # the hop both ends recorded
    # The last stage's proofs are today's: the monolithic model's final states at the output positions pass.
    row = last.rows[0]
    ids = list(row.prompt_ids + row.output_ids)
    hidden = engine.model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    n = len(row.prompt_ids)
    assert all(
        s.exp_mismatches <= 8 for s in check_proof(row.proof, hidden[n - 1 : n - 1 + len(row.output_ids)])
    )


def test_the_group_assignment_is_the_groups_alone(made) -> None:  # noqa: ANN001
    files, tasks, engine, _ = made
    derive = lambda group, batch: work_for(  # noqa: E731
        RUN, tasks, GroupBatch(group, 0, batch, 2, 1), eos_token_id=engine.eos_token_id, pad_token_id=0
    )[1]
    group = files.spec.group_id
    assert derive(group, 0) == derive(group, 0)  # every member and the validator derive the same
    assert derive(group, 1) != derive(group, 0)
    # A group's work is keyed in its own domain: no member's own (node) assignment is its group's.
    member = files.spec.members[0]
    node_work = assign(RUN.run_seed, member, 0, 0, task_count=tasks.task_count, prompts=2, samples=2)
    assert derive(member, 0) != node_work


def test_a_rollout_reader_refuses_a_stage_file_and_the_reverse(made, tmp_path: Path) -> None:  # noqa: ANN001
    files, *_ = made
    with pytest.raises(RolloutFileError, match="pipeline stage's file"):
        read_rollout_file(files.paths[0])


def _rewrite(
    source: Path, target: Path, identity: Identity, change: Callable[[dict[str, list[Any]]], None]
) -> Path:
    """`source`'s table with `change` applied to its columns, written and signed again by `identity`."""
    table = pq.read_table(source)
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    change(columns)
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pydict(columns, schema=STAGE_SCHEMA), sink)
    data = sink.getvalue()
    target.write_bytes(data)
    envelope = json.loads(signature_path(source).read_bytes())
    signed = sign_bytes(
        data, identity, batch=(envelope["policy_step"], envelope["batch_counter"]), group=envelope["group"]
    )
    signature_path(target).write_text(json.dumps(signed))
    return target


def _set(name: str, value: Any, row: int | None = None) -> Callable[[dict[str, list[Any]]], None]:
    def change(columns: dict[str, list[Any]]) -> None:
        rows = range(len(columns[name])) if row is None else [row]
        for i in rows:
            columns[name][i] = value(columns[name][i]) if callable(value) else value

    return change


CASES = {
    "members-short": (_set("group_members", lambda v: v.split(",")[0]), "group_members.*2\\.\\.64"),
    "members-hex": (_set("group_members", lambda v: v.upper()), "group_members.*64 lowercase hex"),
    "members-twice": (_set("group_members", lambda v: ",".join([v.split(",")[0]] * 2)), "group_members"),
    "members-differ": (_set("group_members", lambda v: v[::-1], row=1), "group_members.*row 1 differs"),
    "stage-range": (_set("stage", 7), "'stage': 7 is outside"),
    "micro-batch": (_set("micro_batch_size", 0), "'micro_batch_size': 0 is outside"),
    "stream-rows": (_set("sent_stream", lambda v: b"{}", row=1), "'sent_stream': row 0 holds the stream"),
    "stream-missing": (_set("received_stream", None, row=0), "'received_stream': row 0 holds"),
    "stream-json": (_set("sent_stream", b"{not json", row=0), "'sent_stream': not strict JSON"),
    "stream-schema": (_set("received_stream", b'{"head": 1}', row=0), "'received_stream': malformed"),
    "stream-canonical": (
        _set("sent_stream", lambda v: json.dumps(json.loads(v), indent=1).encode(), row=0),
        "'sent_stream': not the canonical JSON",
    ),
    "signature-hex": (_set("stage_signature", "zz" * 64), "'stage_signature': not 128 lowercase hex"),
    "signature-other": (_set("stage_signature", "ab" * 64), "'stage_signature': not the signer's signature"),
    "proof-middle": (_set("proof", b"\x01" * 258), "this file carries none"),
    "layout-hex": (_set("layout_sha256", "AB" * 32), "'layout_sha256': not 64 lowercase hex"),
    "layout-differs": (_set("layout_sha256", "ab" * 32, row=1), "layout_sha256.*row 1 differs"),
    # Another layout's digest is another group than the one the envelope signs (the layout is part of its id).
    "layout-other": (
        _set("layout_sha256", "ab" * 32),
        "another group than the file's members, run, policy step, layout and nonce",
    ),
    # The group record's formation nonce: 48 lowercase hex digits, the same in every row, and part of the id.
    "nonce-hex": (_set("group_nonce", lambda v: v.upper()), "'group_nonce': not 48 lowercase hex"),
    "nonce-short": (_set("group_nonce", lambda v: v[:-2]), "'group_nonce': not 48 lowercase hex"),
    "nonce-long": (_set("group_nonce", lambda v: v + "00"), "'group_nonce'"),
    "nonce-differs": (_set("group_nonce", lambda v: "0" * 48, row=1), "group_nonce.*row 1 differs"),
    "nonce-other": (
        _set("group_nonce", lambda v: v[:-1] + ("1" if v[-1] == "0" else "0")),
        "another group than the file's members, run, policy step, layout and nonce",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_stage_columns_are_refused_naming_the_column(made, tmp_path: Path, case: str) -> None:  # noqa: ANN001
    files, _, _, members = made
    change, message = CASES[case]
    path = _rewrite(files.paths[0], tmp_path / "bad.parquet", members[0], change)
    with pytest.raises(RolloutFileError, match=message):
        read_stage_file(path)


def test_a_stage_file_signed_by_another_node_or_for_another_group_is_refused(made, tmp_path: Path) -> None:  # noqa: ANN001
    files, _, _, members = made
    path = tmp_path / "copy.parquet"
    shutil.copy(files.paths[0], path)
    data = path.read_bytes()
    envelope = json.loads(signature_path(files.paths[0]).read_bytes())
    batch = (envelope["policy_step"], envelope["batch_counter"])
    signature_path(path).write_text(
        json.dumps(sign_bytes(data, members[1], batch=batch, group=envelope["group"]))
    )
    with pytest.raises(RolloutFileError, match="rows claim node"):
        read_stage_file(path)
    signature_path(path).write_text(json.dumps(sign_bytes(data, members[0], batch=batch, group="ab" * 32)))
    with pytest.raises(RolloutFileError, match="another group"):
        read_stage_file(path)
    signature_path(path).write_text(json.dumps(sign_bytes(data, members[0], batch=batch)))
    with pytest.raises(RolloutFileError, match="rollout file.s; a stage file is signed as"):
        read_stage_file(path)


def test_a_fraud_report_is_read_only_from_the_receiver_and_well_formed(made, tmp_path: Path) -> None:  # noqa: ANN001
    from prime_node.proofs.pipeline.reports import read_fraud_report

    from support.pipeline_files import fraud_report_file

    _, tasks, engine, members = made
    model = make_checkpoint(tmp_path / "model")
    spec, path = fraud_report_file(tmp_path, model, RUN, tasks, engine, members)
    received = read_fraud_report(path)
    assert received.signer == members[1].node_id and received.claim.group_id == spec.group_id
    assert received.hop.opening.stage == 0 and received.hop.headers[-1].kind == "prefill"
    envelope = json.loads(signature_path(path).read_bytes())
    batch = (envelope["policy_step"], envelope["batch_counter"])
    data = path.read_bytes()
    # Signed by the accused itself, not by the stream's receiver: refused.
    signature_path(path).write_text(
        json.dumps(sign_bytes(data, members[0], batch=batch, group=envelope["group"], kind="fraud"))
    )
    with pytest.raises(RolloutFileError, match="not the receiver"):
        read_fraud_report(path)
    # A stage file's kind, a malformed tensor, a field out of bounds: each named.
    signature_path(path).write_text(
        json.dumps(sign_bytes(data, members[1], batch=batch, group=envelope["group"]))
    )
    with pytest.raises(RolloutFileError, match="kind 'fraud'"):
        read_fraud_report(path)
    for field, value, message in (
        ("tensor", "!!", "at tensor"),
        ("claim.prompts", 0, "at claim.prompts"),
        ("claim.members", ["ab" * 32], "at claim.members"),
    ):
        document = json.loads(data)
        holder = document["claim"] if field.startswith("claim.") else document
        holder[field.removeprefix("claim.")] = value
        bad = json.dumps(document).encode()
        path.write_bytes(bad)
        signature_path(path).write_text(
            json.dumps(sign_bytes(bad, members[1], batch=batch, group=envelope["group"], kind="fraud"))
        )
        with pytest.raises(RolloutFileError, match=message):
            read_fraud_report(path)


def test_a_finished_batch_is_judged_whole_and_a_partial_record_cannot_void_it(made, tmp_path: Path) -> None:  # noqa: ANN001
    from prime_node.proofs.pipeline.reports import BatchClaim, PartialReport, write_report
    from prime_node.trainer.validator.group_job import Delivery, verify_group_files

    files, tasks, engine, members = made
    first = read_stage_file(files.paths[0])
    claim = BatchClaim(
        run_id=RUN.run_id,
        policy_step=0,
        batch=0,
        members=list(files.spec.members),
        prompts=2,
        micro_batch_size=1,
        layout_sha256=layout_digest(files.spec.layout),
        nonce=files.spec.nonce,
    )
    partial = tmp_path / "partial.json"
    write_report(partial, PartialReport(claim=claim, record=first.record), members[0])
    deliveries = [Delivery(p, m.node_id) for p, m in zip(files.paths, members, strict=True)]
    deliveries.append(Delivery(partial, members[0].node_id, "partial"))
    assert RUN.pipeline is not None
    judged = verify_group_files(deliveries, RUN, RUN.pipeline, lambda step: (engine, tasks), complete=False)
    assert [(o.accepted, o.failed_check) for _, o in sorted(judged.outcomes.items())] == [
        (True, None),
        (True, None),
        (False, "duplicate"),
    ], judged.outcomes


@pytest.mark.parametrize("liar", [0, 1])
def test_a_member_whose_file_has_another_batch_shape_than_the_runs_is_charged_alone(
    made, tmp_path: Path, liar: int
) -> None:  # noqa: ANN001
    # The run pins the batch's shape (run.pipeline: prompts, micro_batch_size): a file recording another cut is
    # not the run's work, whatever its frames show: that member's fault (`run_parameters`), whichever stage it is.
    # The others are excused (the batch lacks a valid file of that stage), not charged.
    from prime_node.trainer.validator.group_job import INCOMPLETE, Delivery, verify_group_files

    files, tasks, engine, members = made
    paths = list(files.paths)
    paths[liar] = _rewrite(paths[liar], tmp_path / "lie.parquet", members[liar], _set("micro_batch_size", 4))
    deliveries = [Delivery(p, m.node_id) for p, m in zip(paths, members, strict=True)]
    assert RUN.pipeline is not None
    judged = verify_group_files(deliveries, RUN, RUN.pipeline, lambda step: (engine, tasks), complete=True)
    expected = [(False, INCOMPLETE), (False, INCOMPLETE)]
    expected[liar] = (False, "run_parameters")
    assert [(o.accepted, o.failed_check) for _, o in sorted(judged.outcomes.items())] == expected
    assert "micro_batch_size 4, the run's 1" in judged.outcomes[liar].reason, judged.outcomes[liar].reason


def test_a_group_of_another_batch_shape_than_the_runs_is_refused_not_judged(made) -> None:  # noqa: ANN001
    # Honest members that agree with each other but not with the run (a run pinning batches of 4 prompts cut
    # in 2): their files are not the run's work, and the validator says which setting differs.
    from prime_node.trainer.validator.group_job import Delivery, verify_group_files

    files, tasks, engine, members = made
    deliveries = [Delivery(p, m.node_id) for p, m in zip(files.paths, members, strict=True)]
    assert RUN.pipeline is not None
    other = RUN.pipeline.model_copy(update={"prompts": 4, "micro_batch_size": 2})
    judged = verify_group_files(deliveries, RUN, other, lambda step: (engine, tasks), complete=True)
    assert [(o.accepted, o.failed_check) for _, o in sorted(judged.outcomes.items())] == [
        (False, "run_parameters")
    ] * 2
    reason = judged.outcomes[0].reason
    assert "4 rows, the run's 4 prompts x 2 samples" in reason and "micro_batch_size 1, the run's 2" in reason


def test_a_later_stage_signing_frames_of_another_cut_is_charged_alone(made, tmp_path: Path) -> None:  # noqa: ANN001
    # Stage 1 re-signs its sent stream as one micro-batch of 4 while its file records the run's cut (1): its file
    # contradicts its own frames, its fault alone (`assignment`); stage 0 is excused. (Recording the cut of 4 in
    # the file as well is another batch shape than the run's: `run_parameters`, above.)
    from prime_node.proofs.pipeline.records import SignedStageRecord
    from prime_node.proofs.pipeline.schedule import micro_batches
    from prime_node.proofs.pipeline.stage_file import write_stage_file
    from prime_node.trainer.validator.group_job import INCOMPLETE, Delivery, verify_group_files

    from support.pipeline_attacks import rechain

    files, tasks, engine, members = made
    last = read_stage_file(files.paths[1])
    record = last.record.record
    whole = micro_batches([len(r.prompt_ids) for r in last.rows], 4)[0]
    headers, kept = [], False
    for header in record.sent.headers:
        if header.kind == "tokens" and header.step == 0:
            if kept:
                continue
            kept = True
            header = header.model_copy(update={"rows": whole, "shape": [len(whole), *header.shape[1:]]})
        headers.append(header.model_copy(update={"index": len(headers) + 1}))
    sent = rechain(record.sent.model_copy(update={"headers": headers}), members[1])
    signed = SignedStageRecord.sign(record.model_copy(update={"sent": sent}), members[1])
    path = tmp_path / "other-cut.parquet"
    write_stage_file(
        path,
        list(last.rows),
        members[1],
        members=last.members,
        layout_sha256=layout_digest(files.spec.layout),
        nonce=last.nonce,
        micro_batch_size=1,
        signed=signed,
    )
    deliveries = [Delivery(files.paths[0], members[0].node_id), Delivery(path, members[1].node_id)]
    assert RUN.pipeline is not None
    judged = verify_group_files(deliveries, RUN, RUN.pipeline, lambda step: (engine, tasks), complete=True)
    assert [(o.accepted, o.failed_check) for _, o in sorted(judged.outcomes.items())] == [
        (False, INCOMPLETE),
        (False, "assignment"),
    ], judged.outcomes
    assert "not the frames it sent and signed" in judged.outcomes[1].reason, judged.outcomes[1].reason


def test_an_honest_group_is_credited_by_each_stages_share_of_the_layers(made) -> None:  # noqa: ANN001
    from prime_node.trainer.validator.group_job import Delivery, layer_share, verify_group_files

    files, tasks, engine, members = made
    deliveries = [Delivery(p, m.node_id) for p, m in zip(files.paths, members, strict=True)]
    assert RUN.pipeline is not None
    judged = verify_group_files(deliveries, RUN, RUN.pipeline, lambda step: (engine, tasks), complete=True)
    assert [(o.accepted, o.credit_share) for _, o in sorted(judged.outcomes.items())] == [(True, 0.5)] * 2
    uneven = StageLayout(boundaries=[0, 1, 4, 6])
    assert [layer_share(uneven, k) for k in range(3)] == [1 / 6, 3 / 6, 2 / 6]


def test_upheld_fraud_evidence_is_excused_not_credited_and_accuses_once(made, tmp_path: Path) -> None:  # noqa: ANN001
    # Paying for an upheld report lets two sybils farm credit by one framing the other; and the same batch's
    # fraud, reported twice, is charged to the accused once.
    from prime_node.trainer.validator.group_job import REPORT_UPHELD, Delivery, verify_group_files

    _, tasks, engine, members = made
    checkpoint = make_checkpoint(tmp_path / "model")
    _, report = fraud_report_file(tmp_path, checkpoint, RUN, tasks, engine, members)
    deliveries = [Delivery(report, members[1].node_id, "fraud")] * 2
    assert RUN.pipeline is not None
    judged = verify_group_files(deliveries, RUN, RUN.pipeline, lambda step: (engine, tasks), complete=True)
    assert [(o.accepted, o.failed_check) for _, o in sorted(judged.outcomes.items())] == [
        (False, REPORT_UPHELD),
        (False, REPORT_UPHELD),
    ], judged.outcomes
    assert [(a.node_id, a.outcome.failed_check) for a in judged.accusations] == [
        (members[0].node_id, "pipeline")
    ]


def test_a_report_claiming_another_batch_shape_than_the_runs_is_its_reporters_fault(
    made, tmp_path: Path
) -> None:  # noqa: ANN001
    # A claim of one prompt while the run pins two (and the evidence's frame carries rows of two): the evidence is
    # judged by the run's schedule, never the reporter's, so the claim is refused as not the run's batch
    # (`run_parameters`, the reporter's), not a validator failure (internal_error); nobody is accused. (Before the
    # shape was pinned, check_fraud indexed rows the claim did not have: the same reporter's fault.)
    from prime_node.trainer.validator.group_job import Delivery, verify_group_files

    _, tasks, engine, members = made
    _, report = fraud_report_file(tmp_path, make_checkpoint(tmp_path / "model"), RUN, tasks, engine, members)
    document = json.loads(report.read_bytes())
    document["claim"]["prompts"] = 1
    data = json.dumps(document, sort_keys=True).encode()
    report.write_bytes(data)
    envelope = json.loads(signature_path(report).read_bytes())
    batch = (envelope["policy_step"], envelope["batch_counter"])
    signed = sign_bytes(data, members[1], batch=batch, group=envelope["group"], kind="fraud")
    signature_path(report).write_text(json.dumps(signed))
    assert RUN.pipeline is not None
    judged = verify_group_files(
        [Delivery(report, members[1].node_id, "fraud")],
        RUN,
        RUN.pipeline,
        lambda step: (engine, tasks),
        complete=True,
    )
    outcome = judged.outcomes[0]
    assert not outcome.accepted and outcome.failed_check == "run_parameters", outcome
    assert "prompts 1, the run's 2" in outcome.reason and not judged.accusations, outcome.reason


def _signed_report(path: Path, data: bytes, signer: Identity, kind: str = "fraud") -> Path:
    """`data` written over the report at `path`, under `signer`'s envelope for the group and batch it had."""
    envelope = json.loads(signature_path(path).read_bytes())
    batch = (envelope["policy_step"], envelope["batch_counter"])
    path.write_bytes(data)
    signed = sign_bytes(data, signer, batch=batch, group=envelope["group"], kind=kind)
    signature_path(path).write_text(json.dumps(signed))
    return path


def test_a_strangers_report_is_refused_on_its_claim_before_the_rest_is_parsed(made, tmp_path: Path) -> None:  # noqa: ANN001
    from prime_node.proofs.pipeline.reports import read_fraud_report, read_partial_report

    _, tasks, engine, members = made
    _, path = fraud_report_file(tmp_path, make_checkpoint(tmp_path / "model"), RUN, tasks, engine, members)
    claim = json.dumps(json.loads(path.read_bytes())["claim"]).encode()
    # The claim names the group and batch the envelope signs; what follows is 32 MiB that is not JSON at all.
    junk = b'{"claim": ' + claim + b', "hop": ' + b"[" * (32 << 20) + b"}"
    stranger = Identity.generate()
    for kind, read in (("fraud", read_fraud_report), ("partial", read_partial_report)):
        _signed_report(path, junk, stranger, kind)
        with pytest.raises(RolloutFileError, match="signer is not a member of the group it names") as refused:
            read(path)
        assert refused.value.check == "signer"
    # Signed by a member, the same bytes are read on, and the junk is named.
    _signed_report(path, junk, members[1])
    with pytest.raises(RolloutFileError, match="is not strict JSON at hop .or longer than its"):
        read_fraud_report(path)


def test_a_reports_frame_is_held_to_its_size_and_the_schedule_before_its_tensor_is_decoded(
    made, tmp_path: Path
) -> None:  # noqa: ANN001
    from prime_node.proofs.pipeline.reports import read_fraud_report
    from prime_node.trainer.validator.group_job import REPORT_FAILED, Delivery, verify_group_files

    _, tasks, engine, members = made
    _, path = fraud_report_file(tmp_path, make_checkpoint(tmp_path / "model"), RUN, tasks, engine, members)
    document = json.loads(path.read_bytes())
    header = document["hop"]["headers"][-1]
    rows, width, hidden = header["shape"]
    # A header declaring 64 MiB over a tensor of a few KiB: refused from the base64's length, nothing decoded.
    header["shape"] = [rows, 4096, 4096]
    _signed_report(path, json.dumps(document).encode(), members[1])
    with pytest.raises(
        RolloutFileError, match=r"base64 characters, where frame \d+ declares \[1, 4096, 4096\]"
    ):
        read_fraud_report(path)
    # A header declaring the tensor's size in another shape than the schedule's: read, then refused by the
    # schedule's shapes before the tensor is decoded (the reporter's fault, as a claim that does not fit).
    header["shape"] = [rows, width * 2, hidden // 2]
    _signed_report(path, json.dumps(document).encode(), members[1])
    assert read_fraud_report(path).hop.headers[-1].shape == [rows, width * 2, hidden // 2]
    assert RUN.pipeline is not None
    judged = verify_group_files(
        [Delivery(path, members[1].node_id, "fraud")],
        RUN,
        RUN.pipeline,
        lambda step: (engine, tasks),
        complete=True,
    )
    outcome = judged.outcomes[0]
    assert not outcome.accepted and outcome.failed_check == REPORT_FAILED, outcome
    assert "the schedule calls for" in outcome.reason and not judged.accusations, outcome.reason
