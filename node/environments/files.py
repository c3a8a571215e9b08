"""Task sets from a local file: Parquet or JSONL with columns `prompt`, `answer` and optional `task_type`.

The whole file is checked when it is loaded, so a bad row stops the run at start-up with a message that
names the file, the row and the column, instead of surfacing as a zero reward hours later. Extra columns
are ignored. Rows are numbered from 1 (for JSONL the row number is the line number).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import TaskError
from .types import MAX_ANSWER_CHARS, MAX_PROMPT_CHARS, Task
from .verifier import VERIFIERS, integer_match, parse_integer

MAX_FILE_BYTES = 256 * 1024 * 1024
MAX_ROWS = 2_000_000
MAX_JSONL_LINE_BYTES = 1024 * 1024
DEFAULT_FILE_TASK_TYPE = "exact"
REQUIRED_COLUMNS = ("prompt", "answer")
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson")


class FileTaskSet:
    """Tasks held in memory after a complete check of the file they came from."""

    def __init__(self, path: Path, tasks: list[Task], sha256: str) -> None:
        self.path = path
        self.sha256 = sha256  # of the file's bytes: peers compare it to know they use the same tasks
        self._tasks = tasks

    @property
    def name(self) -> str:
        return f"file:{self.path}#sha256={self.sha256}"

    @property
    def identity(self) -> str:
        return f"sha256:{self.sha256}"  # the bytes, not the path: each machine keeps the file where it likes

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, index: int) -> Task:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self._tasks):
            raise TaskError(
                f"task index {index!r} is out of range for {self.path} (0..{len(self._tasks) - 1})"
            )
        return self._tasks[index]


def _check_row(path: Path, row: int, values: dict[str, Any], default_task_type: str) -> Task:
    where = f"{path}: row {row}"
    for column in REQUIRED_COLUMNS:
        if values.get(column) is None:
            raise TaskError(f"{where}: column {column!r} is missing or null")
    prompt, answer = values["prompt"], values["answer"]
    task_type = values.get("task_type")
    if task_type is None:
        task_type = default_task_type
    if not isinstance(prompt, str):
        raise TaskError(f"{where}: column 'prompt' must be a string, got {type(prompt).__name__}")
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)  # {"answer": 46} is as good as {"answer": "46"}
    if not isinstance(answer, str):
        raise TaskError(
            f"{where}: column 'answer' must be a string or an integer, got {type(answer).__name__}"
        )
    if not isinstance(task_type, str):
        raise TaskError(f"{where}: column 'task_type' must be a string, got {type(task_type).__name__}")
    if not prompt or len(prompt) > MAX_PROMPT_CHARS:
        raise TaskError(
            f"{where}: column 'prompt' must have 1..{MAX_PROMPT_CHARS} characters, got {len(prompt)}"
        )
    if not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        raise TaskError(
            f"{where}: column 'answer' must have 1..{MAX_ANSWER_CHARS} characters and not be blank"
        )
    verifier = VERIFIERS.get(task_type)
    if verifier is None:
        known = ", ".join(sorted(VERIFIERS))
        raise TaskError(
            f"{where}: column 'task_type' is {task_type[:80]!r}, which has no verifier (known: {known})"
        )
    if verifier is integer_match and parse_integer(answer.strip()) is None:
        raise TaskError(
            f"{where}: column 'answer' is {answer[:80]!r}, not an integer as task type {task_type!r} needs"
        )
    return Task(prompt=prompt, answer=answer, task_type=task_type)


def _parquet_rows(path: Path, data: bytes) -> list[dict[str, Any]]:
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:
        raise TaskError(f"{path}: not a readable Parquet file ({exc})") from None
    columns = set(parquet.schema_arrow.names)
    for column in REQUIRED_COLUMNS:
        if column not in columns:
            raise TaskError(
                f"{path}: missing column {column!r} (columns: {', '.join(sorted(columns)) or 'none'})"
            )
    if parquet.metadata.num_rows > MAX_ROWS:
        raise TaskError(f"{path}: {parquet.metadata.num_rows} rows, more than the limit of {MAX_ROWS}")
    wanted = [c for c in ("prompt", "answer", "task_type") if c in columns]
    for column in wanted:
        kind = parquet.schema_arrow.field(column).type
        allowed = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        allowed = allowed or (column == "answer" and pa.types.is_integer(kind))
        if not allowed:
            raise TaskError(f"{path}: column {column!r} has type {kind}; it must be a string column")
    try:
        return parquet.read(columns=wanted).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise TaskError(f"{path}: cannot read Parquet data ({exc})") from None


def _jsonl_rows(path: Path, data: bytes) -> list[tuple[int, dict[str, Any]]]:
    rows: list[tuple[int, dict[str, Any]]] = []
    for line_number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue  # blank lines (and the final newline) carry no row
        if len(raw) > MAX_JSONL_LINE_BYTES:
            raise TaskError(f"{path}: row {line_number}: line longer than {MAX_JSONL_LINE_BYTES} bytes")
        if len(rows) >= MAX_ROWS:
            raise TaskError(f"{path}: more than the limit of {MAX_ROWS} rows")
        try:
            value = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TaskError(f"{path}: row {line_number}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise TaskError(f"{path}: row {line_number}: expected a JSON object, got {type(value).__name__}")
        rows.append((line_number, value))
    return rows


def load_task_file(path: Path | str, *, default_task_type: str = DEFAULT_FILE_TASK_TYPE) -> FileTaskSet:
    """Read and fully check a Parquet or JSONL task file; raise TaskError naming the first problem."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise TaskError(f"task file {path} does not exist or is not a file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise TaskError(f"task file {path} is {size} bytes, more than the limit of {MAX_FILE_BYTES}")
    suffix = path.suffix.lower()
    if suffix not in PARQUET_SUFFIXES + JSONL_SUFFIXES:
        allowed = ", ".join(PARQUET_SUFFIXES + JSONL_SUFFIXES)
        raise TaskError(f"task file {path}: unknown format {suffix or '(no suffix)'!r}; use one of {allowed}")
    data = path.read_bytes()[: MAX_FILE_BYTES + 1]
    if suffix in PARQUET_SUFFIXES:
        numbered = list(enumerate(_parquet_rows(path, data), start=1))
    else:
        numbered = _jsonl_rows(path, data)
    if not numbered:
        raise TaskError(f"task file {path} has no rows")
    tasks = [_check_row(path, row, values, default_task_type) for row, values in numbered]
    return FileTaskSet(path, tasks, hashlib.sha256(data).hexdigest())
