"""Parquet bombs against the bounded reader (proofs/rollout_layout.py, proofs/rollout_decode.py).

Every kind is refused from the footer and the page headers, before a column is decoded, with Arrow's
allocations measured by a proxy memory pool; a file at the limits and honest files in every encoding
pyarrow writes by default are read back whole; no mutation of a file raises anything but RolloutFileError.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from prime_node.p2p.identity import Identity
from prime_node.proofs.rollout_file import encode_rows, read_rollout_file, sign_bytes, signature_path
from prime_node.proofs.rollout_schema import RolloutFileError, RolloutLimits

from support import bomb as bombs

KEY = Identity.from_seed(b"\x03" * 32)
ROW = bombs.honest_row(KEY.node_id)
# A run of 64 new tokens; the rest at their defaults (4,096 rows, 4 Mi tokens, 128 MiB decompressed).
LIMITS = RolloutLimits(max_new_tokens=64)
MiB = 1 << 20


@contextlib.contextmanager
def arrow_peak() -> Iterator[pa.MemoryPool]:
    """Arrow's allocations while the block runs (a proxy of the default pool, tracking its own peak)."""
    old = pa.default_memory_pool()
    proxy = pa.proxy_memory_pool(old)
    pa.set_memory_pool(proxy)
    try:
        yield proxy
    finally:
        pa.set_memory_pool(old)


def _signed(tmp_path: Path, data: bytes, name: str = "f.parquet") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    signature_path(path).write_text(json.dumps(sign_bytes(data, KEY, batch=None)))
    return path


# (builder, the check that refuses it, a fragment of the reason); each would decode to 256 MiB or more.
BOMBS: dict[str, tuple[Callable[[], bytes], str, str]] = {
    "constant-tokens": (
        lambda: bombs.constant_tokens(ROW, 4096, 8192, 8192),
        "limits",
        "column 'output_ids' holds 33554432 token ids: more than 4096 rows x max_new_tokens 64",
    ),
    "outputs-over-the-run": (
        lambda: bombs.constant_tokens(ROW, 4096, 16, 8192),
        "limits",
        "more than 4096 rows x max_new_tokens 64 allow",
    ),
    "one-long-row": (lambda: bombs.one_long_row(ROW, 4096, 1 << 24), "limits", "column 'output_ids' holds"),
    "dictionary-value": (
        lambda: bombs.dictionary_proof(ROW, 256, 4 * MiB),
        "limits",
        "dictionary page 0 decompresses to 4194308 bytes for 1 values of at most 520 bytes",
    ),
    "prefix-encoded-value": (lambda: bombs.prefix_proof(ROW, 256, 4 * MiB), "schema", "DELTA_BYTE_ARRAY"),
    "compressed-page": (lambda: bombs.compressed_page(ROW, 64, 4 * MiB), "limits", "decompress to"),
    "row-groups": (
        lambda: bombs.many_row_groups(ROW, 600),
        "schema",
        "malformed Parquet footer: too many structs or collection elements",
    ),
    "lying-footer": (
        lambda: bombs.lie_in_footer(
            bombs.single_page_tokens(ROW, 1024, 16384), {"prompt_ids": 1024, "output_ids": 1024}
        ),
        "schema",
        "the footer declares 1024 values, its pages hold 16777216",
    ),
    "lying-dictionary-header": (
        lambda: bombs.lie_in_dictionary_header(encode_rows([ROW] * 8), "proof", 1 << 28),
        "schema",
        "a dictionary of 268435456 entries in",
    ),
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_bombs_are_refused_before_decoding(tmp_path: Path, name: str):
    build, check, fragment = BOMBS[name]
    path = _signed(tmp_path, build())
    assert path.stat().st_size < (4 * MiB if name == "row-groups" else 64 * 1024)
    with arrow_peak() as pool, pytest.raises(RolloutFileError) as info:
        read_rollout_file(path, LIMITS)
    assert info.value.check == check and fragment in str(info.value), str(info.value)
    # Nothing was decoded: what Arrow allocated is the footer's objects, never the bomb's values.
    assert pool.max_memory() < MiB, pool.max_memory()


def test_a_row_longer_than_the_run_allows_is_refused_before_its_tokens_become_objects(tmp_path: Path):
    # Within the file's total (4,096 rows x 64 tokens) but all in one row: the layout allows it, the decoder
    # checks every row's length on the Arrow array, before a Python tuple is built.
    path = _signed(tmp_path, bombs.one_long_row(ROW, 4096, 4096 * 64 - 4095))
    with (
        arrow_peak() as pool,
        pytest.raises(
            RolloutFileError, match="row 0: output_ids holds 258049 tokens, over max_new_tokens 64"
        ) as info,
    ):
        read_rollout_file(path, LIMITS)
    assert info.value.check == "limits"
    assert pool.max_memory() < 8 * MiB, pool.max_memory()


def test_a_string_longer_than_its_column_allows_is_refused_from_the_dictionary(tmp_path: Path):
    # 600 bytes, over run_id's 4 x 128 (UTF-8 of 128 characters): the dictionary page of 4 rows of it is within
    # the page bound (4 values x (512 + 12) bytes), so the decoder's own check on the dictionary refuses it.
    tab = bombs.table(ROW, 4, run_id=pa.array(["r" * 600] * 4))
    path = _signed(tmp_path, bombs.parquet(tab))
    with pytest.raises(RolloutFileError) as info:
        read_rollout_file(path, LIMITS)
    assert info.value.check == "limits" and "'run_id' holds a value of 600 bytes, over its limit 512" in str(
        info.value
    )


def test_a_file_at_the_limits_decodes_within_its_budget(tmp_path: Path):
    # 4,096 rows of 960 prompt + 64 output tokens: the whole 4 Mi token budget, one value repeated; legal.
    path = _signed(tmp_path, bombs.constant_tokens(ROW, 4096, 960, 64))
    with arrow_peak() as pool:
        rows = read_rollout_file(path, LIMITS).rows
    assert len(rows) == 4096 and sum(len(r.prompt_ids) + len(r.output_ids) for r in rows) == 4 * MiB
    # Arrow decodes one column at a time: 8 bytes a token (its int32 value, its definition and repetition
    # levels) for the larger token column, and nothing of the others alongside.
    assert pool.max_memory() < 36 * MiB, pool.max_memory()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"compression": "snappy"},
        {"compression": "gzip"},
        {"compression": "none"},
        {"compression": "lz4"},
        {"compression": "brotli"},
        {"data_page_version": "2.0"},
        {"use_dictionary": False},
        {"row_group_size": 3},
        {"data_page_size": 64, "write_batch_size": 8},
    ],
)
def test_honest_files_in_default_encodings_are_read_back(tmp_path: Path, options: dict):
    rows = [bombs.honest_row(KEY.node_id, i, output_len=20 + i) for i in range(10)]
    path = _signed(
        tmp_path,
        bombs.parquet(
            bombs.table(ROW, 0).from_pylist([r.to_record() for r in rows], schema=bombs.SCHEMA), **options
        ),
    )
    assert read_rollout_file(path, LIMITS).rows == tuple(rows)


def test_no_mutation_raises_anything_but_a_rollout_file_error(tmp_path: Path):
    # Half the bytes changed land in the footer: pyarrow's metadata accessors abort the whole process on a value
    # they cannot convert (an unknown codec), so the reader must never reach them with one.
    rows = [bombs.honest_row(KEY.node_id, i) for i in range(6)]
    tab = bombs.table(ROW, 0).from_pylist([r.to_record() for r in rows], schema=bombs.SCHEMA)
    bases = [
        encode_rows(rows),
        bombs.parquet(tab, compression="snappy", data_page_version="2.0"),
        bombs.parquet(tab, compression="none", use_dictionary=False),
    ]
    rng = random.Random(0)
    outcomes = {"read": 0, "refused": 0}
    for trial in range(600):
        mutated = bytearray(rng.choice(bases))
        footer = int.from_bytes(mutated[-8:-4], "little")
        for _ in range(rng.choice((1, 1, 2, 4))):
            at = (
                rng.randrange(len(mutated) - 8 - footer, len(mutated) - 8)
                if rng.random() < 0.5
                else rng.randrange(len(mutated))
            )
            mutated[at] = rng.randrange(256) if rng.random() < 0.7 else mutated[at] ^ (1 << rng.randrange(8))
        path = _signed(tmp_path, bytes(mutated), f"m{trial % 4}.parquet")
        try:
            read_rollout_file(path, LIMITS)
            outcomes["read"] += 1
        except RolloutFileError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 200, outcomes
