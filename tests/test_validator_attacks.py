"""Malformed, cheating and unattributable files through a running validator's hand-off.

One validator (real swarm, spool, ledger, DHT bans) and one sending host that speaks for many node ids (each
with its own signed heartbeat). Every file is validly signed by the node it names unless said otherwise:
- non-finite values and schema violations (missing, extra, mistyped column) are faults: rejected with their
  reason, the score docked, no ban; a second fault of the same node within the window bans it (escalation);
- weights quantized to int4, another model's init, rows that name another node than the signer: fraud,
  slashed and banned at once;
- a file altered after signing, or an envelope whose signature is not the named node's: refused at the
  hand-off before a byte is spooled, and attributed to nobody (no verdict, no record, no slash).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prime_node.node.engine import HFEngine
from prime_node.node.models.tiny import build_tiny_model
from prime_node.node.run.validation import RunTasks
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import HandoffRefused, RolloutEnvelope, Swarm
from prime_node.proofs.rollout_file import encode_rows
from prime_node.proofs.rollout_schema import SCHEMA, RolloutRow
from prime_node.trainer.ledger.slashing import SlashingPolicy

from support.attack import MODEL_SEED, engine_from, quantized_engine
from support.swarm import fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    bind_node_ids,
    envelope_for,
    publish_checkpoint,
    rows_for,
    running_validator,
    sees_a_validator,
    validator_settings,
    wait_verdict,
)

Blob = tuple[bytes, RolloutEnvelope]
FAULTS_TO_BAN = 2  # the test's policy: a node's second fault within the window bans it


def _table(rows: list[RolloutRow]) -> pa.Table:
    return pa.Table.from_pylist([r.to_record() for r in rows], schema=SCHEMA)


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _with_type(table: pa.Table, column: str, new: pa.DataType) -> pa.Table:
    fields = [f.with_type(new) if f.name == column else f for f in SCHEMA]
    return table.cast(pa.schema(fields, metadata=SCHEMA.metadata))


def _nan_reward(rows: list[RolloutRow]) -> bytes:
    return encode_rows([dataclasses.replace(rows[0], reward=float("nan")), *rows[1:]])


def _inf_penalty(rows: list[RolloutRow]) -> bytes:
    bad = dataclasses.replace(rows[0], length_penalty=float("inf"), reward=float("-inf"))
    return encode_rows([bad, *rows[1:]])


def _minus_inf_temperature(rows: list[RolloutRow]) -> bytes:
    return encode_rows([dataclasses.replace(r, temperature=float("-inf")) for r in rows])


def _missing_column(rows: list[RolloutRow]) -> bytes:
    return _parquet(_table(rows).drop_columns(["target_length"]))


def _extra_column(rows: list[RolloutRow]) -> bytes:
    extra = pa.field("bonus", pa.float64(), nullable=False)
    return _parquet(_table(rows).append_column(extra, pa.array([1.0] * len(rows))))


def _mistyped_column(rows: list[RolloutRow]) -> bytes:
    return _parquet(_with_type(_table(rows), "task_reward", pa.float32()))


# (what the cheater writes from honest rows, the failed check, a fragment of the reason)
MALFORMED: dict[str, tuple[Callable[[list[RolloutRow]], bytes], str, str]] = {
    "nan-reward": (_nan_reward, "bounds", "reward is not a finite number (nan)"),
    "inf-penalty": (_inf_penalty, "bounds", "length_penalty is not a finite number (inf)"),
    "minus-inf-temperature": (_minus_inf_temperature, "bounds", "temperature is not a finite number (-inf)"),
    "missing-column": (_missing_column, "schema", "missing ['target_length']"),
    "extra-column": (_extra_column, "schema", "unexpected ['bonus']"),
    "mistyped-column": (_mistyped_column, "schema", "column 'task_reward' is float"),
}


def _signed(data: bytes, node: Identity) -> Blob:
    return data, envelope_for(node, data)


async def _node_record(running, node_id: str) -> dict:  # noqa: ANN001
    """What the ledger holds against a node: its score, slashes by class, ban, and files judged."""
    ledger = running.service.ledger
    score = await ledger.query("SELECT score FROM nodes WHERE node_id = ?", (node_id,))
    slashes = await ledger.query("SELECT check_class, amount FROM slashes WHERE node_id = ?", (node_id,))
    files = await ledger.query("SELECT COUNT(*) AS n FROM contributions WHERE node_id = ?", (node_id,))
    return {
        "score": score[0]["score"] if score else None,
        "slashes": [(s["check_class"], s["amount"]) for s in slashes],
        "banned": await ledger.active_ban(node_id) is not None,
        "files": files[0]["n"],
    }


async def _send_and_judge(running, sender: Swarm, blob: Blob) -> tuple[str | None, str]:  # noqa: ANN001
    data, envelope = blob
    await sender.send_rollout(data, envelope)
    verdict = (await wait_verdict(running, envelope.sha256, 60)).document
    assert not verdict.accepted and verdict.node_id == envelope.node_id
    return verdict.failed_check, verdict.reason


async def _banned_in_dht(swarm: Swarm, node_id: str) -> bool:
    return node_id in await swarm.read_bans()


def _cheats(
    engine: HFEngine, tasks: RunTasks, nodes: dict[str, Identity]
) -> dict[str, tuple[Blob, str, str]]:
    """Fraud: (signed file, failed check, reason fragment) per cheating node."""
    int4 = quantized_engine(4)  # the claimed weights, rounded to int4 and back
    other = build_tiny_model(MODEL_SEED + 1)[0]  # the same architecture from another seed
    someone = Identity.generate()
    return {
        "int4": (
            _signed(encode_rows(rows_for(int4, tasks, nodes["int4"])), nodes["int4"]),
            "toploc",
            "row ",
        ),
        "other-seed": (
            _signed(
                encode_rows(rows_for(engine_from(other), tasks, nodes["other-seed"])), nodes["other-seed"]
            ),
            "toploc",
            "row ",
        ),
        # Honest work of another node, signed by this one: claiming someone else's samples.
        "another-signer": (
            _signed(encode_rows(rows_for(engine, tasks, someone)), nodes["another-signer"]),
            "signer",
            "but the file is signed by",
        ),
    }


async def test_malformed_cheating_and_unattributable_files_through_the_handoff(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    checkpoint, engine, tasks = world
    malformed = {name: Identity.generate() for name in MALFORMED}
    fraud = {name: Identity.generate() for name in ("int4", "other-seed", "another-signer")}
    repeat, honest, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    settings = validator_settings(tmp_path / "validator")
    settings = settings.model_copy(update={"slashing": SlashingPolicy(fault_ban_after=FAULTS_TO_BAN)})
    policy = settings.slashing
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    cheats = _cheats(engine, tasks, fraud)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        host = await group.add(bootstrap=running.maddrs[:1], reachability="public")
        await bind_node_ids(host, [*malformed.values(), *fraud.values(), repeat, honest])
        await wait_until(lambda: sees_a_validator(host), 15)

        # Faults: rejected for the named reason, docked the fault penalty once, not banned.
        for name, (write, check, fragment) in MALFORMED.items():
            node = malformed[name]
            blob = _signed(write(rows_for(engine, tasks, node)), node)
            failed, reason = await _send_and_judge(running, host, blob)
            assert failed == check and not reason.startswith(f"{check}:") and fragment in reason, (
                name,
                reason,
            )
            record = await _node_record(running, node.node_id)
            assert record == {
                "score": -policy.fault_penalty,
                "slashes": [("fault", policy.fault_penalty)],
                "banned": False,
                "files": 1,
            }, (name, record)

        # Repeated faults escalate: the second one within the window bans the node, and the ban is in the DHT.
        rows = rows_for(engine, tasks, repeat)
        assert (await _send_and_judge(running, host, _signed(_nan_reward(rows), repeat)))[0] == "bounds"
        assert not (await _node_record(running, repeat.node_id))["banned"]
        assert (await _send_and_judge(running, host, _signed(_missing_column(rows), repeat)))[0] == "schema"
        record = await _node_record(running, repeat.node_id)
        assert record["banned"] and record["slashes"] == [("fault", policy.fault_penalty)] * FAULTS_TO_BAN
        await wait_until(lambda: _banned_in_dht(host, repeat.node_id), 15)

        # Fraud: slashed the fraud penalty and banned at once.
        for name, (blob, check, fragment) in cheats.items():
            failed, reason = await _send_and_judge(running, host, blob)
            assert failed == check and fragment in reason, (name, reason)
            record = await _node_record(running, fraud[name].node_id)
            assert record["banned"] and record["slashes"] == [("fraud", policy.fraud_penalty)], (name, record)
        # ... and refused at the door from then on.
        with pytest.raises(HandoffRefused, match="banned"):
            await host.send_rollout(*_signed(_nan_reward(rows), fraud["int4"]))

        # Unattributable: refused before spooling; nobody's record changes (anyone can name any node id).
        data = encode_rows(rows_for(engine, tasks, honest))
        signed = envelope_for(honest, data)
        altered = bytearray(data)
        altered[len(altered) // 2] ^= 0xFF
        with pytest.raises(HandoffRefused, match="SHA-256"):
            await host.send_rollout(bytes(altered), signed)
        by_stranger = envelope_for(stranger, data).model_copy(update={"node_id": honest.node_id})
        with pytest.raises(HandoffRefused, match="signature does not verify"):
            await host.send_rollout(data, by_stranger)
        for node in (honest, stranger):
            record = await _node_record(running, node.node_id)
            # No score, or the 0 a new node starts at: the validator's peer scan (every 30 s) registers every
            # contributor it sees in the DHT, and `honest` has a contributor heartbeat.
            assert record["score"] in (None, 0.0), record
            assert {k: v for k, v in record.items() if k != "score"} == {
                "slashes": [],
                "banned": False,
                "files": 0,
            }
        # The untouched file still goes through: the refusals held nothing against the honest node.
        await host.send_rollout(data, signed)
        verdict = (await wait_verdict(running, signed.sha256, 60)).document
        assert verdict.accepted, verdict.reason
        assert not (
            await running.service.ledger.query(
                "SELECT 1 FROM contributions WHERE accepted = 1 AND node_id != ?", (honest.node_id,)
            )
        )
