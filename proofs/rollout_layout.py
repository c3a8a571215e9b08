"""What decoding a rollout file would cost, read from its footer and verified against its page headers.

A Parquet file is a few bytes that stand for many: run-length and bit-packed encodings, dictionaries
(one value, referenced by every row) and compression let a 5 kB file decode to gigabytes. Before any
column is decoded, `read_layout` establishes what the decoder will actually hold to:

1. the footer: at most MAX_FOOTER_BYTES, and no more than MAX_FOOTER_STRUCTS structs and list elements,
   read by our own Thrift reader before Arrow builds objects for them (and the only source of the numbers
   below: pyarrow's metadata accessors abort the process on values they cannot convert); at most
   MAX_ROW_GROUPS row groups, the pinned Parquet columns (path, physical type, levels), no column chunk in
   another file;
2. every page header of every column chunk (proofs/parquet_meta.py): the pages must exactly fill the
   byte range the footer gives the chunk and their value counts must add up to the footer's, so the
   footer's counts are the decoder's; only the encodings and codecs named below are accepted.

`check_layout` then holds those numbers to a file's limits (the run's, proofs/verifier.py
`VerifierSettings.file_limits`): rows, token ids per column and per file, bytes per value of every column
(page by page, dictionary pages included: a dictionary entry is as large as the values it stands for), and
bytes decompressed over the whole file. proofs/rollout_decode.py decodes within what this allowed.
"""

from __future__ import annotations

import functools
import io
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from ..p2p.environment_identity import MAX_PIN_CHARS
from .bounds import proof_size
from .parquet_meta import (
    CODECS as CODEC_NAMES,
)
from .parquet_meta import (
    DICTIONARY_PAGE,
    ENCODINGS,
    PHYSICAL_TYPES,
    ChunkMeta,
    FooterMeta,
    Page,
    read_footer,
    walk_pages,
)
from .rollout_schema import MAX_PROMPT_FORMAT_CHARS, SCHEMA, RolloutFileError, RolloutLimits, check_schema

MAX_FOOTER_BYTES = 4 << 20  # one row group of an honest file takes ~5 kB
MAX_FOOTER_STRUCTS = 32_768  # an honest row group takes ~250 (18 column chunks and their statistics)
MAX_ROW_GROUPS = 64  # pyarrow writes one per 1 Mi rows: an honest file has one
MAX_PAGES = 16_384  # per file; pyarrow writes a page per 1 MiB or 20,000 values

# Value encodings accepted: those pyarrow writes by default. Each decodes at most one value of the
# column's width per counted value (a dictionary value is bounded by the dictionary page's own check).
# DELTA_BYTE_ARRAY is refused outright: its values are prefixes of earlier ones, so a page of a few bytes
# decodes to rows x (the longest value) bytes, and Arrow cannot read it as a dictionary.
VALUE_ENCODINGS = frozenset({0, 2, 8})  # PLAIN, PLAIN_DICTIONARY, RLE_DICTIONARY
LEVEL_ENCODINGS = frozenset({3})  # RLE
# Codecs accepted (every one Arrow reads): each decompresses into the buffer the page header sizes, and
# Arrow refuses a page that decompresses to any other size; the headers' sizes are what check_layout bounds.
CODECS = frozenset({"UNCOMPRESSED", "SNAPPY", "GZIP", "BROTLI", "ZSTD", "LZ4", "LZ4_RAW"})

# Per-page slack of the page-size bound (check_layout): level runs and bit-packing headers, dictionary-index
# bit widths; a page within it holds no value longer than its column's limit.
PAGE_SLACK_PER_VALUE = 8
PAGE_SLACK = 1024

TOKEN_COLUMNS = ("prompt_ids", "output_ids")
_WIDTH = {"INT32": 4, "INT64": 8, "DOUBLE": 8}


@functools.cache
def _pinned_leaves(pinned: pa.Schema = SCHEMA) -> tuple[tuple[str, str, int, int], ...]:
    """(path, physical type, max definition level, max repetition level) of every leaf pyarrow writes `pinned` as."""
    sink = io.BytesIO()
    pq.write_table(pinned.empty_table(), sink)
    schema = pq.ParquetFile(pa.BufferReader(sink.getvalue())).schema
    return tuple(_leaf(schema.column(i)) for i in range(len(schema)))


def _leaf(column: pq.ColumnSchema) -> tuple[str, str, int, int]:
    return column.path, column.physical_type, column.max_definition_level, column.max_repetition_level


@dataclass(frozen=True)
class Chunk:
    """One column chunk: its pages, verified against the footer."""

    column: str  # top-level column name
    row_group: int
    rows: int  # of its row group
    values: int  # counted by the decoder: one per value, null or (for a list) empty list
    physical_type: str
    pages: tuple[Page, ...]

    @property
    def uncompressed(self) -> int:
        return sum(p.uncompressed for p in self.pages)


@dataclass(frozen=True)
class Layout:
    rows: int
    row_groups: int
    chunks: tuple[Chunk, ...]

    def values(self, column: str) -> int:
        return sum(c.values for c in self.chunks if c.column == column)

    @property
    def uncompressed(self) -> int:
        return sum(c.uncompressed for c in self.chunks)


def _schema_error(message: str) -> RolloutFileError:
    return RolloutFileError(message, check="schema")


def _footer(data: bytes) -> FooterMeta:
    if len(data) < 12 or data[:4] != b"PAR1" or data[-4:] != b"PAR1":
        raise _schema_error("not a readable Parquet file: no PAR1 magic at both ends")
    length = struct.unpack("<I", data[-8:-4])[0]
    if length > min(MAX_FOOTER_BYTES, len(data) - 12):
        raise _schema_error(
            f"the footer claims {length} bytes; at most {MAX_FOOTER_BYTES} are read, and the "
            f"file has {len(data) - 12}"
        )
    return read_footer(data[-8 - length : -8], MAX_FOOTER_STRUCTS)


def binary_columns(pinned: pa.Schema) -> tuple[str, ...]:
    """The string and binary columns of a schema: read as dictionaries, checked before their values are copied."""
    return tuple(f.name for f in pinned if pa.types.is_string(f.type) or pa.types.is_binary(f.type))


def open_parquet(data: bytes, pinned: pa.Schema = SCHEMA) -> tuple[pq.ParquetFile, FooterMeta]:
    """The file and its footer, checked before Arrow parses it, its Arrow schema exactly `pinned`; binary
    columns are read as dictionaries (proofs/rollout_decode.py)."""
    footer = _footer(data)
    try:
        plain = pq.ParquetFile(
            pa.BufferReader(data),
            pre_buffer=False,
            thrift_string_size_limit=MAX_FOOTER_BYTES,
            thrift_container_size_limit=MAX_FOOTER_STRUCTS,
        )
        check_schema(plain.schema_arrow, pinned)  # as written, before read_dictionary makes dictionaries
        leaves = tuple(_leaf(plain.schema.column(i)) for i in range(len(plain.schema)))
        if leaves != _pinned_leaves(pinned):
            raise _schema_error(f"Parquet columns {leaves} differ from the pinned {_pinned_leaves(pinned)}")
        return pq.ParquetFile(
            pa.BufferReader(data),
            metadata=plain.metadata,
            pre_buffer=False,
            read_dictionary=list(binary_columns(pinned)),
        ), footer
    except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: pyarrow decoding a name as UTF-8
        raise _schema_error(f"not a readable Parquet file: {exc}") from None


def _chunk(
    data: bytes, meta: ChunkMeta, leaf: tuple[str, str, int, int], group: int, rows: int, pages_left: int
) -> Chunk:
    column, physical_type = leaf[0].split(".")[0], leaf[1]
    where = f"column {column!r} of row group {group}"
    # Arrow decodes chunk j as the schema's leaf j: the chunk's own path and type must say the same.
    declared = ".".join(meta.path), PHYSICAL_TYPES.get(meta.physical_type, str(meta.physical_type))
    if declared != (leaf[0], physical_type):
        raise _schema_error(f"{where} declares {declared}, not {(leaf[0], physical_type)}")
    if meta.file_path is not None:
        raise _schema_error(f"{where} lives in another file ({meta.file_path[:64]!r})")
    codec = CODEC_NAMES.get(meta.codec, str(meta.codec))
    if codec not in CODECS:
        raise _schema_error(f"{where} is compressed with {codec}; accepted: {sorted(CODECS)}")
    # Where Arrow's page reader starts (parquet/file_reader.cc, ComputeColumnChunkRange).
    start = meta.data_page_offset
    if meta.dictionary_page_offset is not None and 0 < meta.dictionary_page_offset < start:
        start = meta.dictionary_page_offset
    pages = walk_pages(data, start, meta.total_compressed_size, pages_left)
    counted = sum(p.values for p in pages if p.kind != DICTIONARY_PAGE)
    if counted != meta.num_values:
        raise _schema_error(
            f"{where}: the footer declares {meta.num_values} values, its pages hold {counted}"
        )
    for i, page in enumerate(pages):
        if page.kind == DICTIONARY_PAGE and i != 0:
            raise _schema_error(f"{where}: a dictionary page after the first page")
        if page.encoding not in VALUE_ENCODINGS or not set(page.level_encodings) <= LEVEL_ENCODINGS:
            named = [ENCODINGS.get(e, str(e)) for e in (page.encoding, *page.level_encodings)]
            raise _schema_error(
                f"{where}: page {i} is encoded {named}; values must be PLAIN or dictionary "
                "(RLE_DICTIONARY, PLAIN_DICTIONARY) and levels RLE"
            )
        if codec == "UNCOMPRESSED" and page.compressed != page.uncompressed:
            raise _schema_error(
                f"{where}: an uncompressed page of {page.compressed} bytes claims {page.uncompressed}"
            )
        if page.kind == DICTIONARY_PAGE and page.values * _WIDTH.get(physical_type, 4) > page.uncompressed:
            raise _schema_error(
                f"{where}: a dictionary of {page.values} entries in {page.uncompressed} bytes"
            )
    return Chunk(column, group, rows, meta.num_values, physical_type, tuple(pages))


def read_layout(data: bytes, pinned: pa.Schema = SCHEMA) -> tuple[pq.ParquetFile, Layout]:
    """The opened file and its verified layout; RolloutFileError (check `schema`) if it is malformed."""
    parquet, footer = open_parquet(data, pinned)
    leaves = _pinned_leaves(pinned)
    if len(footer.row_groups) > MAX_ROW_GROUPS:
        raise _schema_error(f"{len(footer.row_groups)} row groups, at most {MAX_ROW_GROUPS}")
    chunks: list[Chunk] = []
    pages = 0
    for g, (rows, metas) in enumerate(footer.row_groups):
        if len(metas) != len(leaves) or rows < 0:
            raise _schema_error(f"row group {g} has {len(metas)} columns and {rows} rows")
        for meta, leaf in zip(metas, leaves, strict=True):
            chunk = _chunk(data, meta, leaf, g, rows, MAX_PAGES - pages)
            pages += len(chunk.pages)
            # One value a row, null or not; a list column a value per element, and one for an empty list.
            if chunk.values < chunk.rows if chunk.column in TOKEN_COLUMNS else chunk.values != chunk.rows:
                raise _schema_error(
                    f"column {chunk.column!r} of row group {g} holds {chunk.values} values for "
                    f"{chunk.rows} rows"
                )
            chunks.append(chunk)
    rows = sum(rows for rows, _ in footer.row_groups)
    if rows != footer.num_rows:
        raise _schema_error(f"the footer declares {footer.num_rows} rows, its row groups hold {rows}")
    return parquet, Layout(rows, len(footer.row_groups), tuple(chunks))


# Bytes of the longest value of each binary column a format adds to SCHEMA's (proofs/pipeline/stage_file.py).
Extra = Mapping[str, int]


def longest_value(column: str, limits: RolloutLimits, extra: Extra | None = None) -> int:
    """Bytes of the longest value a binary column may hold (UTF-8: four a character at most)."""
    if extra is not None and column in extra:
        return extra[column]
    return {
        "run_id": 4 * limits.max_id_chars,
        "node_id": 64,
        "environment": 4 * MAX_PIN_CHARS,
        "prompt_format": 4 * MAX_PROMPT_FORMAT_CHARS,
        "finish_reason": len("length"),
        "proof": proof_size(limits.max_new_tokens),
    }[column]


def value_bytes(column: str, physical_type: str, limits: RolloutLimits, extra: Extra | None = None) -> int:
    """The most bytes one value of `column` may take encoded as PLAIN (binary: its 4-byte length first)."""
    return _WIDTH.get(physical_type) or 4 + longest_value(column, limits, extra)


def proof_bytes(output_tokens: int, rows: int) -> int:
    """The most bytes `rows` proofs of `output_tokens` output tokens in all take, PLAIN-encoded: 258 bytes per
    32 tokens or part of 32, so at most one part-chunk a row (proofs/toploc.py)."""
    return proof_size(output_tokens) + rows * (proof_size(1) + 4)


def _limit_error(message: str) -> RolloutFileError:
    return RolloutFileError(message, check="limits")


def check_layout(layout: Layout, limits: RolloutLimits, extra: Extra | None = None) -> None:
    """Hold the verified layout to `limits` (RolloutFileError, check `limits`), so that decoding stays within
    what honest files of those limits need (docs/protocol.md, "Rollout files (the validator's judgement)")."""
    if not 1 <= layout.rows <= limits.max_rows:
        raise _limit_error(f"{layout.rows} rows, allowed 1..{limits.max_rows}")
    per_row = {
        "prompt_ids": ("max_prompt_tokens", limits.max_prompt_tokens),
        "output_ids": ("max_new_tokens", limits.max_new_tokens),
    }
    for column, (name, most) in per_row.items():
        held = layout.values(column)
        if held > layout.rows * most:
            raise _limit_error(
                f"column {column!r} holds {held} token ids: more than {layout.rows} rows x "
                f"{name} {most} allow"
            )
    tokens = sum(layout.values(c) for c in TOKEN_COLUMNS)
    if tokens > limits.max_file_tokens:
        raise _limit_error(
            f"the file holds {tokens} token ids, over the limit of {limits.max_file_tokens} per file"
        )
    if layout.uncompressed > limits.max_decoded_bytes:
        raise _limit_error(
            f"the pages decompress to {layout.uncompressed} bytes, over the limit {limits.max_decoded_bytes}"
        )
    for chunk in layout.chunks:
        widest = value_bytes(chunk.column, chunk.physical_type, limits, extra) + PAGE_SLACK_PER_VALUE
        for i, page in enumerate(chunk.pages):
            most = page.values * widest + PAGE_SLACK
            if page.uncompressed > most:
                kind = "dictionary page" if page.kind == DICTIONARY_PAGE else "page"
                raise _limit_error(
                    f"column {chunk.column!r}, row group {chunk.row_group}, {kind} {i} decompresses to "
                    f"{page.uncompressed} bytes for {page.values} values of at most "
                    f"{widest - PAGE_SLACK_PER_VALUE} bytes each (allowed: {most})"
                )
        if chunk.column == "proof":
            outputs = next(
                c for c in layout.chunks if c.column == "output_ids" and c.row_group == chunk.row_group
            )
            most = proof_bytes(outputs.values, chunk.rows) + PAGE_SLACK * len(chunk.pages)
            if chunk.uncompressed > most:
                raise _limit_error(
                    f"column 'proof', row group {chunk.row_group}: {chunk.uncompressed} bytes for "
                    f"{outputs.values} output tokens in {chunk.rows} rows, which need at most {most}"
                )
        dictionary = chunk.pages[0] if chunk.pages and chunk.pages[0].kind == DICTIONARY_PAGE else None
        if dictionary is not None and dictionary.values > chunk.values:
            raise _limit_error(
                f"column {chunk.column!r}, row group {chunk.row_group}: a dictionary of "
                f"{dictionary.values} entries for {chunk.values} values"
            )
