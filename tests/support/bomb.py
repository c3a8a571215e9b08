"""Parquet bombs: signed rollout files that are small on disk and huge once decoded, built with pyarrow the
way an attacker would (tests/test_validator_bombs.py, tests/test_rollout_layout.py, benchmarks/validator_bombs.py).

Each builder takes an honest row (whose header fields, run id, node id, step, it copies) and returns the
Parquet bytes of a file under the pinned schema; `lie_in_footer` rewrites a file's footer (Thrift compact
protocol, re-encoded here) so that it declares less than its pages hold.
"""

from __future__ import annotations

import dataclasses
import io
import struct
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from prime_node.proofs.rollout_schema import SCHEMA, RolloutRow
from prime_node.proofs.toploc import build_proof


def honest_row(node_id: str, index: int = 0, output_len: int = 40, **changes: Any) -> RolloutRow:
    """A row within every bound (no model: its proof commits to random states), for files read without a model."""
    rng = np.random.default_rng(index)
    row = RolloutRow(
        run_id="run-a",
        node_id=node_id,
        policy_step=3,
        batch_counter=1,
        sample_index=17 + index,
        sample_seed=2**62 + index,
        temperature=1.0,
        max_new_tokens=64,
        environment="arithmetic prime-node==0.1.0 sha256:" + "0" * 64,
        prompt_format="raw",
        prompt_ids=tuple(int(t) for t in rng.integers(2, 250, 12)),
        output_ids=tuple(int(t) for t in rng.integers(2, 250, output_len - 1)) + (1,),
        finish_reason="eos",
        task_reward=1.0,
        length_penalty=0.25,
        reward=0.75,
        target_length=20,
        proof=build_proof(torch.from_numpy(rng.standard_normal((output_len, 128), dtype=np.float32))),
    )
    return dataclasses.replace(row, **changes)


# ----- tables from column arrays, without a Python object per token ------------------------------------


def _constant_lists(rows: int, lengths: np.ndarray | int, token: int = 7) -> pa.ListArray:
    lengths = np.broadcast_to(np.asarray(lengths, dtype=np.int64), (rows,))
    offsets = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.array(np.full(int(offsets[-1]), token, dtype=np.int32))
    return pa.ListArray.from_arrays(pa.array(offsets), values, type=SCHEMA.field("prompt_ids").type)


def _zero_values(rows: int, value_bytes: int) -> pa.BinaryArray:
    """`rows` values of `value_bytes` zero bytes each, over one calloc'ed buffer: the pages it spans are never
    written, so building a gigabyte of them costs the builder no resident memory."""
    offsets = np.arange(rows + 1, dtype=np.int32) * np.int32(value_bytes)  # int32: under 2 GiB in all
    data = np.zeros(rows * value_bytes, dtype=np.uint8)
    return pa.BinaryArray.from_buffers(pa.binary(), rows, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def table(row: RolloutRow, rows: int, **columns: pa.Array) -> pa.Table:
    """`rows` copies of `row`'s values, with the arrays in `columns` in place of theirs."""
    arrays = []
    for field in SCHEMA:
        if field.name in columns:
            arrays.append(columns[field.name])
            continue
        value = getattr(row, field.name)
        if field.name in ("prompt_ids", "output_ids"):
            arrays.append(pa.array([list(value)] * rows, field.type))
        else:
            arrays.append(pa.array([value] * rows, field.type))
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


def parquet(tab: pa.Table, **options: Any) -> bytes:
    sink = io.BytesIO()
    pq.write_table(tab, sink, **{"compression": "zstd", **options})
    return sink.getvalue()


# ----- the bombs ----------------------------------------------------------------------------------------


def constant_tokens(row: RolloutRow, rows: int, prompt: int, output: int) -> bytes:
    """Every row holds `prompt` + `output` copies of one token: dictionary indices in one RLE run (a 17 kB
    file of 4,096 x (8,192 + 8,192) tokens grew a validator by 2 GB)."""
    return parquet(
        table(row, rows, prompt_ids=_constant_lists(rows, prompt), output_ids=_constant_lists(rows, output))
    )


def one_long_row(row: RolloutRow, rows: int, output: int) -> bytes:
    """Row 0's output holds `output` tokens, every other row one: a single record as long as the whole file's
    token budget (the decoder cannot stop within a record)."""
    lengths = np.ones(rows, dtype=np.int64)
    lengths[0] = output
    return parquet(
        table(row, rows, output_ids=_constant_lists(rows, lengths)),
        data_page_size=1 << 30,
        max_rows_per_page=1 << 30,
    )


def dictionary_proof(row: RolloutRow, rows: int, value_bytes: int) -> bytes:
    """Every row's proof is one `value_bytes` value, stored once in a dictionary page (256 rows of one 4 MiB
    value took a validator from 2.66 to 3.96 GB)."""
    return parquet(
        table(row, rows, proof=_zero_values(rows, value_bytes)),
        dictionary_pagesize_limit=value_bytes + (1 << 20),
    )


def prefix_proof(row: RolloutRow, rows: int, value_bytes: int) -> bytes:
    """DELTA_BYTE_ARRAY: every value after the first is 'all of the previous one': the same blow-up as a
    dictionary, and Arrow cannot read it as a dictionary."""
    return parquet(
        table(row, rows, proof=_zero_values(rows, value_bytes)),
        use_dictionary=["run_id"],
        column_encoding={"proof": "DELTA_BYTE_ARRAY"},
    )


def compressed_page(row: RolloutRow, rows: int, value_bytes: int) -> bytes:
    """PLAIN proofs of `value_bytes` zero bytes in one page: zstd shrinks them to almost nothing, the decoder
    decompresses the page whole."""
    return parquet(
        table(row, rows, proof=_zero_values(rows, value_bytes)),
        use_dictionary=False,
        data_page_size=1 << 30,
        max_rows_per_page=1 << 30,
    )


def many_row_groups(row: RolloutRow, rows: int) -> bytes:
    """One row group per row: the footer grows with the groups, and Arrow builds objects for every one."""
    return parquet(table(row, rows), row_group_size=1)


def unknown_step(row: RolloutRow, rows: int, prompt: int, output: int, step: int) -> bytes:
    """The constant-token bomb claiming a policy step the validator does not hold: it used to be decoded,
    then held, then excused as checkpoint_unavailable."""
    return constant_tokens(dataclasses.replace(row, policy_step=step), rows, prompt, output)


def single_page_tokens(row: RolloutRow, rows: int, per_row: int) -> bytes:
    """The constant-token bomb with each token column in one page (what lie_in_footer needs)."""
    lists = _constant_lists(rows, per_row)
    return parquet(
        table(row, rows, prompt_ids=lists, output_ids=lists),
        data_page_size=1 << 30,
        max_rows_per_page=1 << 30,
    )


# ----- rewriting a footer: Thrift compact protocol, decoded to a tree and encoded back -----------------

_STRUCT, _LIST, _SET, _MAP, _BINARY, _DOUBLE, _TRUE, _FALSE, _I8 = 12, 9, 10, 11, 8, 7, 1, 2, 3


class _Decoder:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, ctype: int) -> Any:
        if ctype in (_TRUE, _FALSE):
            return ctype == _TRUE
        if ctype == _I8:
            return self.byte()
        if ctype in (4, 5, 6):
            return self.zigzag()
        if ctype == _DOUBLE:
            self.pos += 8
            return self.data[self.pos - 8 : self.pos]
        if ctype == _BINARY:
            n = self.varint()
            self.pos += n
            return self.data[self.pos - n : self.pos]
        if ctype in (_LIST, _SET):
            head = self.byte()
            size, etype = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            items = [self.byte() == 1 if etype in (_TRUE, _FALSE) else self.value(etype) for _ in range(size)]
            return (etype, items)
        if ctype == _STRUCT:
            fields, last = [], 0
            while (head := self.byte()) != 0:
                delta, t = head >> 4, head & 0x0F
                fid = last + delta if delta else self.zigzag()
                fields.append([fid, t, self.value(t)])
                last = fid
            return fields
        raise ValueError(f"compact type {ctype} not handled")


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        if n < 0x80:
            return bytes(out + bytes([n]))
        out.append((n & 0x7F) | 0x80)
        n >>= 7


def _encode(ctype: int, value: Any) -> bytes:
    if ctype in (_TRUE, _FALSE):
        return b""
    if ctype == _I8:
        return bytes([value])
    if ctype in (4, 5, 6):
        return _zigzag(value)
    if ctype == _DOUBLE:
        return value
    if ctype == _BINARY:
        return _varint(len(value)) + value
    if ctype in (_LIST, _SET):
        etype, items = value
        head = (
            bytes([(len(items) << 4) | etype])
            if len(items) < 15
            else bytes([0xF0 | etype]) + _varint(len(items))
        )
        return head + b"".join(
            bytes([1 if v else 2]) if etype in (_TRUE, _FALSE) else _encode(etype, v) for v in items
        )
    if ctype == _STRUCT:
        out, last = bytearray(), 0
        for fid, t, v in value:
            t = (_TRUE if v else _FALSE) if t in (_TRUE, _FALSE) else t
            out += bytes([((fid - last) << 4) | t]) if 0 < fid - last <= 15 else bytes([t]) + _zigzag(fid)
            out += _encode(t, v)
            last = fid
        return bytes(out + b"\x00")
    raise ValueError(f"compact type {ctype} not handled")


def _field(fields: list, fid: int) -> list:
    return next(f for f in fields if f[0] == fid)


def lie_in_footer(data: bytes, columns: dict[str, int]) -> bytes:
    """`data` with the footer declaring `columns[name]` values for the named columns (ColumnMetaData
    num_values, field 5) and as many uncompressed bytes as compressed ones (field 6), in every row group."""
    length = struct.unpack("<I", data[-8:-4])[0]
    body = data[: -8 - length]
    meta = _Decoder(data[-8 - length : -8]).value(_STRUCT)
    for group in _field(meta, 4)[2][1]:  # FileMetaData.row_groups
        for chunk in _field(group, 1)[2][1]:  # RowGroup.columns
            column = _field(chunk, 3)[2]  # ColumnChunk.meta_data
            name = _field(column, 3)[2][1][0].decode()  # path_in_schema[0]
            if name in columns:
                _field(column, 5)[2] = columns[name]
                _field(column, 6)[2] = _field(column, 7)[2]
    footer = _encode(_STRUCT, meta)
    return body + footer + struct.pack("<I", len(footer)) + b"PAR1"


def _chunks(meta: list) -> list[tuple[str, list, list]]:
    """(column name, ColumnChunk fields, ColumnMetaData fields) of every column chunk of a decoded footer."""
    found = []
    for group in _field(meta, 4)[2][1]:
        for chunk in _field(group, 1)[2][1]:
            column = _field(chunk, 3)[2]
            found.append((_field(column, 3)[2][1][0].decode(), chunk, column))
    return found


def lie_in_dictionary_header(data: bytes, column: str, entries: int) -> bytes:
    """`data` with the dictionary page of `column` (first row group) declaring `entries` entries: a decoder
    that sized its dictionary from the header alone would allocate entries x the value width. The bytes
    after the header move with its new length, and the footer's offsets with them."""
    length = struct.unpack("<I", data[-8:-4])[0]
    meta = _Decoder(data[-8 - length : -8]).value(_STRUCT)
    name, _, target = next(c for c in _chunks(meta) if c[0] == column)
    at = _field(target, 11)[2]  # dictionary_page_offset
    decoder = _Decoder(data)
    decoder.pos = at
    header = decoder.value(_STRUCT)
    _field(_field(header, 7)[2], 1)[2] = entries  # DictionaryPageHeader.num_values
    new = _encode(_STRUCT, header)
    shift = len(new) - (decoder.pos - at)
    body = data[:at] + new + data[decoder.pos : -8 - length]
    for _, chunk, fields in _chunks(meta):
        for fid in (9, 10, 11):  # data, index, dictionary page offsets
            found = [f for f in fields if f[0] == fid]
            if found and found[0][2] > at:
                found[0][2] += shift
        for f in chunk:
            if f[0] == 2 and f[2] > at:  # ColumnChunk.file_offset
                f[2] += shift
    for fid in (6, 7):  # this chunk's total uncompressed and compressed sizes include the header
        _field(target, fid)[2] += shift
    footer = _encode(_STRUCT, meta)
    return body + footer + struct.pack("<I", len(footer)) + b"PAR1"
