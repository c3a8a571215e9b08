"""Rollout files: round trip, and every rejection reason (signature, size, schema, bounds) asserted."""

from __future__ import annotations

import dataclasses
import io
import json
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import RolloutEnvelope
from prime_node.proofs.rollout_file import (
    encode_rows,
    envelope_batch,
    parse_envelope,
    read_bounded,
    read_rollout_file,
    sign_bytes,
    signature_path,
    write_rollout_file,
)
from prime_node.proofs.rollout_schema import (
    FLOAT_COLUMNS,
    SCHEMA,
    RolloutFileError,
    RolloutLimits,
    RolloutRow,
)
from prime_node.proofs.toploc import build_proof

KEY = Identity.from_seed(b"\x01" * 32)
OTHER = Identity.from_seed(b"\x02" * 32)


def _row(index: int = 0, output_len: int = 40, **changes) -> RolloutRow:
    hidden = torch.randn(output_len, 128, generator=torch.Generator().manual_seed(index))
    row = RolloutRow(
        run_id="run-a",
        node_id=KEY.node_id,
        policy_step=3,
        batch_counter=1,
        sample_index=17 + index,
        sample_seed=2**62 + index,
        temperature=1.0,
        max_new_tokens=64,
        environment="arithmetic prime-node==0.1.0 sha256:" + "0" * 64,
        prompt_format="raw",
        prompt_ids=(5, 6, 7),
        output_ids=tuple([9] * (output_len - 1) + [1]),
        finish_reason="eos",
        task_reward=1.0,
        length_penalty=0.25,
        reward=0.75,
        target_length=20,
        proof=build_proof(hidden),
    )
    return dataclasses.replace(row, **changes)


def _write_raw(path: Path, data: bytes, identity: Identity = KEY) -> Path:
    path.write_bytes(data)
    signature_path(path).write_text(json.dumps(sign_bytes(data, identity, batch=None)))
    return path


def _table_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _rejects(path: Path, match: str, check: str, **kw) -> None:
    with pytest.raises(RolloutFileError, match=match) as info:
        read_rollout_file(path, **kw)
    assert info.value.check == check


def test_round_trip(tmp_path: Path):
    rows = [
        _row(0),
        _row(
            1,
            output_len=64,
            finish_reason="length",
            output_ids=(9,) * 64,
            target_length=None,
            length_penalty=0.0,
            reward=1.0,
            proof=build_proof(torch.ones(64, 128)),
        ),
    ]
    path = tmp_path / "batch.parquet"
    sig = write_rollout_file(path, rows, KEY)
    assert sig == tmp_path / "batch.parquet.sig"
    got = read_rollout_file(path, RolloutLimits(vocab_size=288), expected_signer=KEY.node_id)
    assert got.rows == tuple(rows)
    assert got.signer == KEY.node_id
    assert len(got.rows[0].proof) == 2 * 258 and len(got.rows[1].proof) == 2 * 258
    assert got.rows[1].target_length is None


def test_writer_refuses_bad_rows_and_foreign_node_id(tmp_path: Path):
    with pytest.raises(RolloutFileError, match="reward"):
        write_rollout_file(tmp_path / "a.parquet", [_row(reward=5.0)], KEY)
    with pytest.raises(RolloutFileError, match="another node id"):
        write_rollout_file(tmp_path / "a.parquet", [_row()], OTHER)


def test_tampered_file_and_other_keys_are_rejected(tmp_path: Path):
    path = tmp_path / "b.parquet"
    write_rollout_file(path, [_row()], KEY)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    _rejects(path, "altered after signing", "signature")

    # a valid file, but the envelope's signature was made by another key
    path = tmp_path / "c.parquet"
    write_rollout_file(path, [_row()], KEY)
    envelope = json.loads(signature_path(path).read_text())
    forged = sign_bytes(path.read_bytes(), OTHER, batch=(0, 0))
    signature_path(path).write_text(json.dumps({**envelope, "signature": forged["signature"]}))
    _rejects(path, "bad signature", "signature")

    # signed by another key that names itself: rows claim a node that did not sign
    _write_raw(path, path.read_bytes(), OTHER)
    _rejects(path, "signed by", "signature")
    write_rollout_file(path, [_row()], KEY)
    _rejects(path, "expected", "signature", expected_signer=OTHER.node_id)


def test_a_file_is_read_into_a_buffer_of_its_size_not_of_its_limit(tmp_path: Path):
    # A fraud report's limit is 357 MiB: reading a small file into a buffer of the limit cost that much each time.
    path = tmp_path / "small"
    path.write_bytes(b"x" * 1000)
    tracemalloc.start()
    try:
        assert read_bounded(path, 256 << 20, "file") == b"x" * 1000
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_size_limit_and_envelope_checked_before_parsing(tmp_path: Path):
    path = _write_raw(tmp_path / "d.parquet", b"\x00" * 5000)  # not Parquet at all
    _rejects(path, "over the 2048-byte limit", "signature", limits=RolloutLimits(max_file_bytes=2048))
    signature_path(path).unlink()
    _rejects(path, "does not exist", "signature")
    for bad in (
        b"not json",
        b"[]",
        json.dumps({"format": "x"}).encode(),
        json.dumps({**sign_bytes(b"", KEY, batch=None), "size": "5"}).encode(),
        json.dumps({**sign_bytes(b"", KEY, batch=None), "extra": 1}).encode(),
        b"{" + b" " * 5000 + b"}",
    ):
        signature_path(path).write_bytes(bad)
        _rejects(path, "signature", "signature")
    _write_raw(path, b"\x00" * 5000)
    _rejects(path, "not a readable", "schema")


def _valid_table() -> pa.Table:
    return pa.Table.from_pylist([_row().to_record()], schema=SCHEMA)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda t: t.drop_columns(["proof"]), r"missing \['proof'\]"),
        (lambda t: t.append_column("bonus", pa.array([1.0])), r"unexpected \['bonus'\]"),
        (
            lambda t: t.set_column(t.schema.get_field_index("reward"), "reward", pa.array(["1"])),
            "'reward' is string",
        ),
        (
            lambda t: t.set_column(
                t.schema.get_field_index("policy_step"), "policy_step", pa.array([3], pa.int32())
            ),
            "'policy_step' is int32",
        ),
        (
            lambda t: t.cast(pa.schema([f.with_nullable(True) for f in SCHEMA], metadata=SCHEMA.metadata)),
            "nullable",
        ),
        (lambda t: t.select(list(reversed(SCHEMA.names))), "out of order"),
        (lambda t: t.replace_schema_metadata({}), "metadata"),
    ],
)
def test_schema_violations(tmp_path: Path, mutate, match: str):
    path = _write_raw(tmp_path / "e.parquet", _table_bytes(mutate(_valid_table())))
    _rejects(path, match, "schema")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"reward": float("nan")}, "reward is not a finite number"),
        ({"temperature": float("inf")}, "temperature is not a finite number"),
        ({"task_reward": 1.5, "reward": 1.25}, r"task reward 1.5 outside \[0, 1\]"),
        ({"reward": 1.0}, "reward 1.0 != task reward"),
        ({"length_penalty": -2.0, "reward": 3.0}, "length penalty -2.0 outside"),
        ({"length_penalty": 100.0, "reward": -99.0}, r"length penalty 100.0 outside \[0, 64\]"),
        ({"target_length": None}, "without a target length"),
        ({"prompt_ids": (5, 300)}, "outside the vocabulary"),
        ({"prompt_ids": (-1,)}, "outside the vocabulary"),
        ({"max_new_tokens": 10}, "output has 40 tokens"),
        ({"finish_reason": "stop"}, "finish reason"),
        ({"sample_seed": -5}, "sample seed"),
        ({"sample_index": -1}, "sample_index is negative"),
        ({"temperature": 0.0}, "temperature 0.0 outside"),
        ({"proof": b"\x00" * 258}, "proof is 258 bytes, expected 516"),
        ({"node_id": "AB" * 32}, "lowercase hex"),
        ({"prompt_ids": ()}, "prompt has 0 tokens"),
        (
            {"target_length": 0, "length_penalty": 0.0, "reward": 1.0},
            r"target length 0 outside \[1, 1000000\]",
        ),
    ],
)
def test_value_bounds(tmp_path: Path, changes: dict, match: str):
    path = _write_raw(tmp_path / "f.parquet", encode_rows([_row(**changes)]))
    _rejects(path, match, "bounds", limits=RolloutLimits(vocab_size=288))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_every_float_column_must_be_finite(tmp_path: Path, value: float):
    # The float columns come from the schema, so a float column added later is covered here too.
    assert {"temperature", "task_reward", "length_penalty", "reward"} <= set(FLOAT_COLUMNS)
    for column in FLOAT_COLUMNS:
        rows = [_row(i, **{column: value}) for i in range(2)]
        path = _write_raw(tmp_path / f"{column}.parquet", encode_rows(rows))
        _rejects(path, rf"row 0: {column} is not a finite number \({value}\)", "bounds")


def test_rows_must_share_the_batch_header(tmp_path: Path):
    path = _write_raw(tmp_path / "g.parquet", encode_rows([_row(0), _row(1, policy_step=4)]))
    _rejects(path, "row 1: policy_step 4 differs", "bounds")
    # NaN differs from itself: a NaN temperature on every row is named as non-finite, not as a header mismatch.
    path = _write_raw(
        tmp_path / "n.parquet", encode_rows([_row(i, temperature=float("nan")) for i in range(2)])
    )
    _rejects(path, r"row 0: temperature is not a finite number \(nan\)", "bounds")
    path = _write_raw(tmp_path / "h.parquet", encode_rows([_row(i) for i in range(3)]))
    _rejects(path, "3 rows, allowed 1..2", "limits", limits=RolloutLimits(max_rows=2))


def test_the_envelope_signs_the_batch_and_older_envelopes_are_still_read(tmp_path: Path):
    """v2 (what the writer signs) names the batch every row holds; v1 (no batch) stays readable; the wire type
    of the hand-off (p2p/swarm/handoff.py) reads and verifies both exactly as this reader does."""
    path = tmp_path / "v2.parquet"
    write_rollout_file(path, [_row(0), _row(1)], KEY)
    envelope = json.loads(signature_path(path).read_text())
    assert envelope["format"] == "prime-node/rollout-sig/v2"
    assert (envelope["policy_step"], envelope["batch_counter"]) == (3, 1)
    assert envelope_batch(parse_envelope(signature_path(path).read_bytes())) == (3, 1)
    read_rollout_file(path)
    wire = RolloutEnvelope.model_validate_json(signature_path(path).read_bytes(), strict=True)
    wire.verify()
    assert wire.batch == (3, 1) and json.loads(wire.model_dump_json()) == envelope  # the same document

    # A v1 envelope (written before v2) over the same bytes: read, no batch to compare.
    old = sign_bytes(path.read_bytes(), KEY, batch=None)
    assert sorted(old) == ["format", "node_id", "sha256", "signature", "size"]
    signature_path(path).write_text(json.dumps(old))
    assert read_rollout_file(path).signer == KEY.node_id
    wire = RolloutEnvelope.model_validate_json(json.dumps(old), strict=True)
    wire.verify()
    assert wire.batch is None and json.loads(wire.model_dump_json()) == old

    # Each format has exactly its own fields: a batch in v1, or v2 without one (or null), is refused.
    for bad in (
        {**old, "policy_step": 3, "batch_counter": 1},
        {**old, "policy_step": None, "batch_counter": None},
        {k: v for k, v in envelope.items() if k != "batch_counter"},
        {**envelope, "policy_step": -1},
        {**envelope, "batch_counter": True},
        {**envelope, "policy_step": 2**63},
        {**envelope, "format": "prime-node/rollout-sig/v3"},
    ):
        signature_path(path).write_text(json.dumps(bad))
        _rejects(path, "signature", "signature")
        with pytest.raises(ValueError):
            RolloutEnvelope.model_validate_json(json.dumps(bad), strict=True)


def test_rows_of_another_batch_than_the_envelope_signs_are_rejected(tmp_path: Path):
    """The batch decides which validator judges a file: rows of another batch under it are the signer's lie."""
    data = encode_rows([_row(0), _row(1)])  # batch 1 of step 3
    for batch, match in (
        ((3, 2), "signs batch 2 of policy step 3"),
        ((4, 1), "signs batch 1 of policy step 4"),
    ):
        path = tmp_path / f"{batch}.parquet"
        path.write_bytes(data)
        signature_path(path).write_text(json.dumps(sign_bytes(data, KEY, batch=batch)))
        _rejects(path, rf"the rows are batch 1 of policy step 3, but the envelope {match}", "signature")
    # Rows that hold no one batch are malformed whatever the envelope says: the bounds check names them.
    mixed = encode_rows([_row(0), _row(1, batch_counter=2)])
    path = tmp_path / "mixed.parquet"
    path.write_bytes(mixed)
    signature_path(path).write_text(json.dumps(sign_bytes(mixed, KEY, batch=(3, 1))))
    _rejects(path, "row 1: batch_counter 2 differs", "bounds")


def test_a_length_target_beyond_the_runs_max_new_tokens_is_in_bounds(tmp_path: Path):
    # A run may aim at lengths its max_new_tokens cuts short; the reader given the run's own limits (as stage files
    # are read) must take such rows as the default limits do, or honest pipelined work is refused as `bounds`.
    path = _write_raw(tmp_path / "t.parquet", encode_rows([_row(target_length=100)]))
    read_rollout_file(path, RolloutLimits(vocab_size=288, max_new_tokens=64))
