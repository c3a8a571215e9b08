"""The footer and the page headers of a Parquet file, read strictly, so that a reader can bound what decoding costs.

The footer says how many values a column chunk holds, but the decoder follows the page headers: each page's
`num_values` is how many values it decodes (however few bytes their run-length or bit-packed encoding
takes) and its `uncompressed_page_size` is the buffer it decompresses into. A file may lie in its footer;
it cannot lie to the decoder. So the pages are walked here the way Arrow's page reader walks them (from
the chunk's first page, each header followed by `compressed_page_size` bytes), and proofs/rollout_layout.py
accepts a chunk only if its pages exactly fill the byte range the footer gives it and their value counts add
up to the footer's: then the footer's numbers are the decoder's, and bounds checked on them hold while
decoding.

The footer itself is read here too, before Arrow parses it: its size in structs is bounded (Arrow builds
objects for every one), and the numbers the layout needs come from this reader, never from pyarrow's
metadata accessors, which abort the process on a value they cannot convert (an unknown codec, say).

Thrift compact protocol, as parquet.thrift defines it; strict where Thrift is lenient: a known field of
the wrong type or out of its integer range, a repeated field, a missing required field or an unknown page
type rejects the file, so this reader never reads a number Arrow would not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .rollout_schema import RolloutFileError

# Page types (parquet.thrift PageType) a chunk may hold; INDEX_PAGE and unknown types are refused (Arrow
# would skip them, which would let bytes sit in the chunk that no check looked at).
DATA_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 2, 3
PAGE_TYPES = {DATA_PAGE: "data", DICTIONARY_PAGE: "dictionary", DATA_PAGE_V2: "data-v2"}

# Enumerations of parquet.thrift by name, for messages and for comparing with pyarrow's schema.
PHYSICAL_TYPES = {
    0: "BOOLEAN",
    1: "INT32",
    2: "INT64",
    3: "INT96",
    4: "FLOAT",
    5: "DOUBLE",
    6: "BYTE_ARRAY",
    7: "FIXED_LEN_BYTE_ARRAY",
}
CODECS = {0: "UNCOMPRESSED", 1: "SNAPPY", 2: "GZIP", 3: "LZO", 4: "BROTLI", 5: "LZ4", 6: "ZSTD", 7: "LZ4_RAW"}
ENCODINGS = {
    0: "PLAIN",
    2: "PLAIN_DICTIONARY",
    3: "RLE",
    4: "BIT_PACKED",
    5: "DELTA_BINARY_PACKED",
    6: "DELTA_LENGTH_BYTE_ARRAY",
    7: "DELTA_BYTE_ARRAY",
    8: "RLE_DICTIONARY",
    9: "BYTE_STREAM_SPLIT",
}

MAX_HEADER_BYTES = 4096  # an honest page header is tens of bytes (statistics of one binary value at most)
_MAX_DEPTH = 8  # FileMetaData > row groups > RowGroup > columns > ColumnChunk > ... > Statistics, at most

# Compact protocol type ids.
_TRUE, _FALSE, _I8, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
_INT_BITS = {_I8: 8, _I16: 16, _I32: 32, _I64: 64}

# The fields this reader uses (parquet.thrift), per struct: field id -> (compact type, what is inside: a struct's
# fields, or for a list (element type, element fields)). Fields not listed are read for their length only.
_Fields = dict[int, "tuple[int, _Fields | tuple[int, _Fields | None] | None]"]
_I32_FIELD, _I64_FIELD, _BINARY_FIELD = (_I32, None), (_I64, None), (_BINARY, None)
_DATA_V1: _Fields = {1: _I32_FIELD, 2: _I32_FIELD, 3: _I32_FIELD, 4: _I32_FIELD}
_DICTIONARY: _Fields = {1: _I32_FIELD, 2: _I32_FIELD}
_DATA_V2: _Fields = {1: _I32_FIELD, 2: _I32_FIELD, 3: _I32_FIELD, 4: _I32_FIELD, 5: _I32_FIELD, 6: _I32_FIELD}
_PAGE_HEADER: _Fields = {
    1: _I32_FIELD,
    2: _I32_FIELD,
    3: _I32_FIELD,
    4: _I32_FIELD,
    5: (_STRUCT, _DATA_V1),
    6: (_STRUCT, {}),
    7: (_STRUCT, _DICTIONARY),
    8: (_STRUCT, _DATA_V2),
}
# ColumnMetaData: type, path_in_schema, codec, num_values, total_compressed_size, data and dictionary page offsets.
_COLUMN_META: _Fields = {
    1: _I32_FIELD,
    2: (_LIST, (_I32, None)),
    3: (_LIST, (_BINARY, None)),
    4: _I32_FIELD,
    5: _I64_FIELD,
    6: _I64_FIELD,
    7: _I64_FIELD,
    9: _I64_FIELD,
    11: _I64_FIELD,
}
_COLUMN_CHUNK: _Fields = {1: _BINARY_FIELD, 2: _I64_FIELD, 3: (_STRUCT, _COLUMN_META)}
_ROW_GROUP: _Fields = {1: (_LIST, (_STRUCT, _COLUMN_CHUNK)), 3: _I64_FIELD}
_FILE_META: _Fields = {3: _I64_FIELD, 4: (_LIST, (_STRUCT, _ROW_GROUP))}


def _malformed(message: str, what: str = "page header") -> RolloutFileError:
    return RolloutFileError(f"malformed Parquet {what}: {message}", check="schema")


class _Reader:
    """Compact-protocol values from `data[pos:end]`; every read is bounds-checked, nesting is limited to
    `_MAX_DEPTH` levels and the structs and collection elements read to `budget` (each costs Arrow an object
    when it parses the same bytes)."""

    def __init__(self, data: memoryview, pos: int, end: int, budget: int, what: str = "page header") -> None:
        self.data, self.pos, self.end, self.budget, self.what = data, pos, end, budget, what

    def fail(self, message: str) -> RolloutFileError:
        return _malformed(message, self.what)

    def byte(self) -> int:
        if self.pos >= self.end:
            raise self.fail("truncated")
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
            if shift > 63:
                raise self.fail("varint longer than 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, n: int) -> None:
        if self.pos + n > self.end:
            raise self.fail("truncated")
        self.pos += n

    def spend(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            raise self.fail("too many structs or collection elements")

    def value(self, ctype: int, depth: int, inside: object = None) -> object:
        """One value of compact type `ctype`: ints, bytes, structs as {field id: value}, lists as lists when
        `inside` names their element type (else read for their length only, as maps are)."""
        if ctype in (_TRUE, _FALSE):  # a bool field's value is its type id
            return ctype == _TRUE
        if ctype == _I8:
            value = self.byte()
            return value - 256 if value > 127 else value
        if ctype in (_I16, _I32, _I64):
            value = self.zigzag()
            if not -(1 << _INT_BITS[ctype] - 1) <= value < 1 << _INT_BITS[ctype] - 1:
                raise self.fail(f"an integer of {_INT_BITS[ctype]} bits holds {value}")
            return value
        if ctype == _DOUBLE:
            self.skip(8)
            return None
        if ctype == _BINARY:
            n = self.varint()
            self.skip(n)
            return bytes(self.data[self.pos - n : self.pos])
        if depth >= _MAX_DEPTH:
            raise self.fail("values nested too deep")
        if ctype == _STRUCT:
            return self.struct(inside if isinstance(inside, dict) else {}, depth + 1)
        if ctype in (_LIST, _SET):
            head = self.byte()
            size, etype = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            self.spend(size)
            want, fields = inside if isinstance(inside, tuple) else (None, None)
            if want is not None and size and etype != want:
                raise self.fail(f"a list of compact type {etype}, expected {want}")
            # Every element takes a byte at least: `size` cannot outrun the bytes.
            items = [
                self.byte() == _TRUE if etype in (_TRUE, _FALSE) else self.value(etype, depth + 1, fields)
                for _ in range(size)
            ]
            return items if want is not None else None
        if ctype == _MAP:
            size = self.varint()
            self.spend(size)
            if size:
                kinds = self.byte()
                for _ in range(size):
                    for kind in (kinds >> 4, kinds & 0x0F):
                        self.byte() if kind in (_TRUE, _FALSE) else self.value(kind, depth + 1)
            return None
        raise self.fail(f"unknown compact type {ctype}")

    def struct(self, layout: _Fields, depth: int) -> dict[int, object]:
        """A struct's fields; a field `layout` lists with another type is refused (Thrift would skip it, and a
        reader that skipped what Arrow reads, or the reverse, could bound the wrong numbers)."""
        self.spend(1)
        fields: dict[int, object] = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:  # STOP
                return fields
            delta, ctype = head >> 4, head & 0x0F
            fid = last + delta if delta else self.zigzag()
            last = fid
            if fid in fields:
                raise self.fail(f"field {fid} appears twice")
            want, inside = layout.get(fid, (ctype, None))
            if ctype != want and not {ctype, want} <= {_TRUE, _FALSE}:
                raise self.fail(f"field {fid} has compact type {ctype}, expected {want}")
            fields[fid] = self.value(ctype, depth, inside)


@dataclass(frozen=True)
class ChunkMeta:
    """A column chunk as the footer declares it (ColumnChunk and its ColumnMetaData)."""

    path: tuple[str, ...]  # path_in_schema
    physical_type: int  # parquet.thrift Type
    codec: int  # parquet.thrift CompressionCodec
    num_values: int
    total_compressed_size: int
    data_page_offset: int
    dictionary_page_offset: int | None
    file_path: bytes | None  # a chunk stored in another file


@dataclass(frozen=True)
class FooterMeta:
    num_rows: int
    row_groups: tuple[tuple[int, tuple[ChunkMeta, ...]], ...]  # (rows, chunks) per row group


def _required(fields: dict[int, Any], fid: int, what: str, reader: _Reader) -> Any:
    if fid not in fields:
        raise reader.fail(f"missing {what}")
    return fields[fid]


def read_footer(footer: bytes, max_structs: int) -> FooterMeta:
    """The footer (FileMetaData), refused when it holds more than `max_structs` structs and collection
    elements or nests deeper than any Parquet footer, before Arrow parses it: a footer of tiny structs (a byte
    each) would otherwise cost Arrow hundreds of bytes of objects per byte of file."""
    reader = _Reader(memoryview(footer), 0, len(footer), max_structs, "footer")
    meta = reader.struct(_FILE_META, 0)
    if reader.pos != len(footer):
        raise reader.fail(f"{len(footer) - reader.pos} bytes after the footer's end")
    if 8 in meta:  # encryption_algorithm: nothing here is encrypted
        raise reader.fail("an encrypted file")
    groups = []
    for group in _required(meta, 4, "row groups", reader) or []:
        chunks = []
        for chunk in _required(group, 1, "a row group's columns", reader) or []:
            if 8 in chunk or 9 in chunk:
                raise reader.fail("an encrypted column chunk")
            _required(chunk, 2, "file_offset", reader)
            column = _required(chunk, 3, "a column chunk's metadata", reader)
            assert isinstance(column, dict)
            names = (
                "type",
                "encodings",
                "path_in_schema",
                "codec",
                "num_values",
                "total_uncompressed_size",
                "total_compressed_size",
                "data_page_offset",
            )
            values = [
                _required(column, fid, name, reader) for fid, name in zip((1, 2, 3, 4, 5, 6, 7, 9), names)
            ]
            try:
                path = tuple(bytes(p).decode() for p in values[2])
            except UnicodeDecodeError:
                raise reader.fail("a column path that is not UTF-8") from None
            chunks.append(
                ChunkMeta(
                    path, values[0], values[3], values[4], values[6], values[7], column.get(11), chunk.get(1)
                )
            )
        groups.append((_required(group, 3, "a row group's num_rows", reader), tuple(chunks)))
    return FooterMeta(_required(meta, 3, "num_rows", reader), tuple(groups))


@dataclass(frozen=True)
class Page:
    """One page as its header declares it."""

    kind: int  # DATA_PAGE, DICTIONARY_PAGE or DATA_PAGE_V2
    offset: int  # of the header, in the file
    compressed: int  # bytes after the header
    uncompressed: int  # bytes the decoder decompresses them into
    values: int  # values decoded (levels for nested columns; entries of a dictionary)
    encoding: int  # of the values
    level_encodings: tuple[int, ...]  # of the definition and repetition levels (data page v1)


def _int(fields: dict[int, object], fid: int, what: str) -> int:
    value = fields.get(fid)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _malformed(f"missing {what}")
    if not 0 <= value < 2**31:
        raise _malformed(f"{what} {value} is negative or over 2^31")
    return value


def read_page(data: memoryview, pos: int, end: int) -> tuple[Page, int]:
    """The page whose header starts at `pos`; returns it and the offset just past its data (at most `end`)."""
    reader = _Reader(data, pos, min(end, pos + MAX_HEADER_BYTES), MAX_HEADER_BYTES)
    header = reader.struct(_PAGE_HEADER, 0)
    kind = _int(header, 1, "page type")
    if kind not in PAGE_TYPES:
        raise _malformed(f"page type {kind} (only data, dictionary and data v2 pages are read)")
    compressed = _int(header, 3, "compressed_page_size")
    uncompressed = _int(header, 2, "uncompressed_page_size")
    sub_id = {DATA_PAGE: 5, DICTIONARY_PAGE: 7, DATA_PAGE_V2: 8}[kind]
    sub = header.get(sub_id)
    if not isinstance(sub, dict) or any(k in header for k in (5, 6, 7, 8) if k != sub_id):
        raise _malformed(f"a {PAGE_TYPES[kind]} page needs exactly its own sub-header")
    values = _int(sub, 1, "num_values")
    encoding = _int(sub, {DATA_PAGE: 2, DICTIONARY_PAGE: 2, DATA_PAGE_V2: 4}[kind], "encoding")
    levels: tuple[int, ...] = ()
    if kind == DATA_PAGE:
        levels = (_int(sub, 3, "definition level encoding"), _int(sub, 4, "repetition level encoding"))
    elif kind == DATA_PAGE_V2:
        level_bytes = _int(sub, 5, "definition levels length") + _int(sub, 6, "repetition levels length")
        if level_bytes > min(compressed, uncompressed) or _int(sub, 3, "num_rows") > values:
            raise _malformed("data page v2 levels larger than the page, or more rows than values")
    after = reader.pos + compressed
    if after > end:
        raise _malformed(f"page at {pos} runs {after - end} bytes past the end of its column chunk")
    return Page(kind, pos, compressed, uncompressed, values, encoding, levels), after


def walk_pages(data: bytes, start: int, length: int, max_pages: int) -> list[Page]:
    """Every page of the column chunk at data[start:start + length], which they must fill exactly."""
    view = memoryview(data)
    end = start + length
    if start < 4 or length < 1 or end > len(data):
        raise _malformed(f"column chunk [{start}, {end}) lies outside the file")
    pages: list[Page] = []
    pos = start
    while pos < end:
        if len(pages) == max_pages:
            raise RolloutFileError(f"a column chunk holds more than {max_pages} pages", check="schema")
        page, pos = read_page(view, pos, end)
        pages.append(page)
    return pages
