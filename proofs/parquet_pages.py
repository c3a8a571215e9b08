"""The page headers of a Parquet column chunk, read strictly, so that a reader can bound what decoding costs.

The footer says how many values a column chunk holds and how large it is once decompressed, but the
decoder follows the page headers: each page's `num_values` is how many values it decodes (however few
bytes their run-length or bit-packed encoding takes) and its `uncompressed_page_size` is the buffer it
decompresses into. A file may lie in its footer; it cannot lie to the decoder. So the pages are walked here
the way Arrow's page reader walks them (from the chunk's first page, each header followed by
`compressed_page_size` bytes) and the chunk is accepted only if the pages exactly fill the byte range the
footer gives it and their value counts add up to the footer's: then the footer's numbers are the
decoder's, and bounds checked on them hold while decoding.

Thrift compact protocol, as parquet.thrift defines PageHeader; strict where Thrift would be lenient: a
known field of the wrong type, a repeated field, or an unknown page type rejects the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rollout_schema import RolloutFileError

# Page types (parquet.thrift PageType) a chunk may hold; INDEX_PAGE and unknown types are refused (Arrow
# would skip them, which would let bytes sit in the chunk that no check looked at).
DATA_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 2, 3
PAGE_TYPES = {DATA_PAGE: "data", DICTIONARY_PAGE: "dictionary", DATA_PAGE_V2: "data-v2"}

# Encodings (parquet.thrift Encoding) by name, for messages; see rollout_layout.ALLOWED_ENCODINGS.
ENCODINGS = {0: "PLAIN", 2: "PLAIN_DICTIONARY", 3: "RLE", 4: "BIT_PACKED", 5: "DELTA_BINARY_PACKED",
             6: "DELTA_LENGTH_BYTE_ARRAY", 7: "DELTA_BYTE_ARRAY", 8: "RLE_DICTIONARY", 9: "BYTE_STREAM_SPLIT"}

MAX_HEADER_BYTES = 4096  # an honest page header is tens of bytes (statistics of one binary value at most)
_MAX_DEPTH = 8  # FileMetaData > RowGroup list > RowGroup > ColumnChunk list > ... > Statistics; deeper is no Parquet

# Compact protocol type ids.
_TRUE, _FALSE, _I8, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
# The compact type of every field of a page header this reader uses (parquet.thrift): field id -> (type,
# nested layout of a struct). Fields not listed (statistics, crc, bools) are read for their length only.
Layout = dict[int, "tuple[int, Layout | None]"]
_DATA_V1: Layout = {1: (_I32, None), 2: (_I32, None), 3: (_I32, None), 4: (_I32, None)}
_DICTIONARY: Layout = {1: (_I32, None), 2: (_I32, None)}
_DATA_V2: Layout = {1: (_I32, None), 2: (_I32, None), 3: (_I32, None), 4: (_I32, None), 5: (_I32, None),
                    6: (_I32, None)}
_PAGE_HEADER: Layout = {1: (_I32, None), 2: (_I32, None), 3: (_I32, None), 4: (_I32, None), 5: (_STRUCT, _DATA_V1),
                        6: (_STRUCT, {}), 7: (_STRUCT, _DICTIONARY), 8: (_STRUCT, _DATA_V2)}


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

    def value(self, ctype: int, depth: int, layout: Layout | None = None) -> object:
        """One value of compact type `ctype`: ints as int, structs as {field id: value}, other kinds skipped."""
        if ctype in (_TRUE, _FALSE):  # a bool field's value is its type id
            return ctype == _TRUE
        if ctype == _I8:
            return self.byte()
        if ctype in (_I16, _I32, _I64):
            return self.zigzag()
        if ctype == _DOUBLE:
            return self.skip(8)
        if ctype == _BINARY:
            return self.skip(self.varint())
        if depth >= _MAX_DEPTH:
            raise self.fail("values nested too deep")
        if ctype == _STRUCT:
            return self.struct(layout or {}, depth + 1)
        if ctype in (_LIST, _SET):
            head = self.byte()
            size, etype = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            self.spend(size)
            for _ in range(size):  # every element takes a byte at least: `size` cannot outrun the bytes
                self.byte() if etype in (_TRUE, _FALSE) else self.value(etype, depth + 1)
            return None
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

    def struct(self, layout: Layout, depth: int) -> dict[int, object]:
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
            want, nested = layout.get(fid, (ctype, None))
            if ctype != want:
                raise self.fail(f"field {fid} has compact type {ctype}, expected {want}")
            fields[fid] = self.value(ctype, depth, nested)


def check_footer_shape(footer: bytes, max_structs: int) -> None:
    """Refuse a footer (FileMetaData) holding more than `max_structs` structs and collection elements, or
    nested deeper than any Parquet footer, before Arrow parses it: a footer of tiny structs (a byte each)
    would otherwise cost Arrow hundreds of bytes of objects per byte of file."""
    reader = _Reader(memoryview(footer), 0, len(footer), max_structs, "footer")
    reader.struct({}, 0)
    if reader.pos != len(footer):
        raise reader.fail(f"{len(footer) - reader.pos} bytes after the footer's end")


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
