"""Decoding a rollout file within the bounds its verified layout was held to (proofs/rollout_layout.py).

Column by column, each checked before the next is read and before any of it becomes Python objects:
- the policy step alone first (`read_policy_step`: eight bytes a row), so that a validator knows which
  checkpoint the file claims before it decodes the rest;
- token lists: every row's length against the run's per-row limits (the layout bounded only their sum);
- strings and the proof: read as Arrow dictionaries, never expanded: every entry is checked against its
  column's byte limit and the rows share the Python object of their entry, so a value referenced by every
  row costs its bytes once (a dictionary bomb decodes to what it weighs on the page).
Arrow reads one column chunk at a time (use_threads=False), so at most one column's decoding buffers are
alive at once, beside the Python rows built so far.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .rollout_layout import (
    TOKEN_COLUMNS,
    Extra,
    Layout,
    binary_columns,
    check_layout,
    longest_value,
    read_layout,
)
from .rollout_schema import COLUMNS, SCHEMA, RolloutFileError, RolloutLimits, RolloutRow


def _read(parquet: pq.ParquetFile, column: str) -> pa.ChunkedArray:
    try:
        table = parquet.read(columns=[column], use_threads=False)
        # Decoded is not valid: strings must be UTF-8 and dictionary indices within their dictionary before
        # Python objects are made of them.
        table.validate(full=True)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise RolloutFileError(f"column {column!r} cannot be decoded: {exc}", check="schema") from None
    return table.column(0)


def read_policy_step(parquet: pq.ParquetFile) -> int:
    """The one policy step every row claims (RolloutFileError, check `bounds`, if rows disagree)."""
    steps = pc.unique(_read(parquet, "policy_step")).to_pylist()
    if len(steps) != 1:
        raise RolloutFileError(
            f"rows claim {len(steps)} policy steps ({sorted(steps)[:4]}…); a file holds one", check="bounds"
        )
    if steps[0] < 0:
        raise RolloutFileError(f"policy step {steps[0]} is negative", check="bounds")
    return steps[0]


def _tokens(column: str, array: pa.ChunkedArray, most: int, name: str) -> Iterator[tuple[int, ...]]:
    row = 0
    for chunk in array.chunks:
        lengths = pc.list_value_length(chunk)
        longest = pc.max(lengths).as_py()
        if longest is not None and longest > most:
            at = row + pc.index(lengths, longest).as_py()
            raise RolloutFileError(
                f"row {at}: {column} holds {longest} tokens, over {name} {most}", check="limits"
            )
        offsets, values = chunk.offsets.to_numpy(), chunk.values.to_numpy()
        for i in range(len(chunk)):
            yield tuple(values[offsets[i] : offsets[i + 1]].tolist())
        row += len(chunk)


def _entries(column: str, array: pa.ChunkedArray, most: int | None) -> Iterator[Any]:
    """The values of a dictionary-read column, each row sharing its entry's Python object."""
    for chunk in array.chunks:
        if most is not None:
            lengths = pc.binary_length(chunk.dictionary)
            longest = pc.max(lengths).as_py()
            if longest is not None and longest > most:
                raise RolloutFileError(
                    f"column {column!r} holds a value of {longest} bytes, over its limit {most}",
                    check="limits",
                )
        entries = chunk.dictionary.to_pylist()
        if chunk.null_count:  # a nullable column (a stage file's streams): None where the row holds none
            for position in chunk.indices.to_pylist():
                yield None if position is None else entries[position]
            continue
        for index in chunk.indices.to_numpy(zero_copy_only=False):
            yield entries[index]


def decode_layout(parquet: pq.ParquetFile, layout: Layout, limits: RolloutLimits) -> list[RolloutRow]:
    """The rows of a file whose layout passed check_layout(layout, limits)."""
    values = decode_columns(parquet, layout, limits, SCHEMA)
    return [
        RolloutRow(**dict(zip(COLUMNS, fields, strict=True))) for fields in zip(*values.values(), strict=True)
    ]


def decode_columns(
    parquet: pq.ParquetFile,
    layout: Layout,
    limits: RolloutLimits,
    pinned: pa.Schema,
    extra: Extra | None = None,
) -> dict[str, list[Any]]:
    """Every column of `pinned` (SCHEMA's first, then those a format adds, bounded by `extra`), as Python values
    per row, of a file whose layout passed check_layout(layout, limits, extra)."""
    values: dict[str, list[Any]] = {}
    per_row = {
        "prompt_ids": ("max_prompt_tokens", limits.max_prompt_tokens),
        "output_ids": ("max_new_tokens", limits.max_new_tokens),
    }
    binary = binary_columns(pinned)
    for column in pinned.names:
        array = _read(parquet, column)
        if column in TOKEN_COLUMNS:
            name, most = per_row[column]
            values[column] = list(_tokens(column, array, most, name))
        elif column in binary:
            # The proof's byte limit is per row (its output's length): the layout bounded the column's total,
            # the bounds check compares every proof with its exact size.
            longest = None if column == "proof" else longest_value(column, limits, extra)
            values[column] = list(_entries(column, array, longest))
        else:
            if not array.type.equals(pinned.field(column).type):
                raise RolloutFileError(f"column {column!r} decodes as {array.type}", check="schema")
            values[column] = array.to_pylist()
        del array  # its Arrow buffers go before the next column is decoded
        if len(values[column]) != layout.rows:
            raise RolloutFileError(
                f"column {column!r} decodes to {len(values[column])} rows, not {layout.rows}"
            )
    return values


def decode_file(data: bytes, limits: RolloutLimits) -> list[RolloutRow]:
    """Every row of signed Parquet bytes, decoded within `limits`: layout, its bounds, then the columns."""
    parquet, layout = read_layout(data)
    check_layout(layout, limits)
    return decode_layout(parquet, layout, limits)
