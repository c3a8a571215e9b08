"""The `file` environment: tasks from a local Parquet or JSONL file, scored by each row's task type.

Columns: `prompt`, `answer`, optional `task_type` (default `exact`) and optional `metadata` (a JSON object
the task type's scorer reads: a program's tests). Task types: `integer` and `arithmetic` (the final answer
is the same integer), `exact` (the same text up to whitespace), `math` and `code` (verifier.py,
EXTERNAL_TASK_TYPES). The whole file is checked when it is loaded, so a bad row stops the run at start-up
with a message that names the file, the row and the column, instead of surfacing as a zero reward hours
later. Extra columns are ignored. Rows are numbered from 1 (for JSONL the row number is the line number).

Its identity's content hash is the SHA-256 of the file's bytes (what `sha256sum` prints), not its path:
each machine keeps the file where it likes, and the run pins the bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import TaskError
from .environment import EnvironmentIdentity, ScoringLimits
from .registry import builtin_identity, path_arg, split_args
from .types import MAX_ANSWER_CHARS, MAX_METADATA_CHARS, MAX_PROMPT_CHARS, Task, check_index
from .verifier import TaskScorer, known_task_types, parse_integer, task_scorer

NAME = "file"
MAX_FILE_BYTES = 256 * 1024 * 1024
MAX_ROWS = 2_000_000
MAX_JSONL_LINE_BYTES = 1024 * 1024
DEFAULT_FILE_TASK_TYPE = "exact"
REQUIRED_COLUMNS = ("prompt", "answer")
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
_ISOLATION_ORDER = ("inline", "process", "sandbox")


class FileEnvironment:
    """Tasks held in memory after a complete check of the file they came from."""

    def __init__(self, path: Path, tasks: list[Task], sha256: str) -> None:
        self.path = path
        self.sha256 = sha256  # of the file's bytes: peers compare it to know they use the same tasks
        self._tasks = tasks
        self._identity = builtin_identity(NAME, f"sha256:{sha256}")
        # Every task type the file uses, resolved now: a missing scorer stops the run at start-up.
        self._scorers: dict[str, TaskScorer] = {}
        isolation = "inline"
        for task_type in sorted({t.task_type for t in tasks}):
            self._scorers[task_type], needs = task_scorer(task_type)
            isolation = max(isolation, needs, key=_ISOLATION_ORDER.index)
        self._scoring = ScoringLimits(isolation=isolation)

    @property
    def spec(self) -> str:
        return f"{NAME}:{path_arg(NAME, self.path)}"

    @property
    def identity(self) -> EnvironmentIdentity:
        return self._identity

    @property
    def scoring(self) -> ScoringLimits:
        return self._scoring

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, index: int) -> Task:
        check_index(index, len(self._tasks), self.path)
        return self._tasks[index]

    def score(self, completion: str, task: Task) -> float:
        scorer = self._scorers.get(task.task_type)
        return 0.0 if scorer is None else scorer(completion, task)


def open_file(args: str, *, seed: int = 0) -> FileEnvironment:
    """Tasks from a local Parquet or JSONL file: `file:PATH` (columns prompt, answer, task_type, metadata)."""
    path = split_args(NAME, args, positional="path", known=["path"]).get("path")
    if path is None:
        raise TaskError(f"{NAME}: give the task file's path, as {NAME}:PATH")
    return load_task_file(path)


def metadata_text(where: str, value: Any) -> str:
    """A row's `metadata` as canonical JSON of an object (a JSON object, or a string holding one)."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        if len(value) > MAX_METADATA_CHARS:
            raise TaskError(f"{where}: column 'metadata' is longer than {MAX_METADATA_CHARS} characters")
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{where}: column 'metadata' is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise TaskError(f"{where}: column 'metadata' must be a JSON object, got {type(value).__name__}")
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError) as exc:
        raise TaskError(f"{where}: column 'metadata' has no canonical JSON form ({exc})") from None
    if len(text) > MAX_METADATA_CHARS:
        raise TaskError(f"{where}: column 'metadata' is longer than {MAX_METADATA_CHARS} characters")
    return text


def _check_row(path: Path, row: int, values: dict[str, Any]) -> Task:
    where = f"{path}: row {row}"
    for column in REQUIRED_COLUMNS:
        if values.get(column) is None:
            raise TaskError(f"{where}: column {column!r} is missing or null")
    prompt, answer = values["prompt"], values["answer"]
    task_type = values.get("task_type")
    if task_type is None:
        task_type = DEFAULT_FILE_TASK_TYPE
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
    if task_type not in known_task_types():
        raise TaskError(
            f"{where}: column 'task_type' is {task_type[:80]!r}, which has no verifier "
            f"(known: {', '.join(known_task_types())})"
        )
    if task_type in ("arithmetic", "integer") and parse_integer(answer.strip()) is None:
        raise TaskError(
            f"{where}: column 'answer' is {answer[:80]!r}, not an integer as task type {task_type!r} needs"
        )
    metadata = metadata_text(where, values.get("metadata"))
    return Task(prompt=prompt, answer=answer, task_type=task_type, metadata=metadata)


def _parquet_rows(path: Path, data: bytes, optional: dict[str, str]) -> list[dict[str, Any]]:
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
    kinds = {"prompt": "string", "answer": "string or integer", **optional}
    wanted = [c for c in kinds if c in columns]
    for column in wanted:
        kind = parquet.schema_arrow.field(column).type
        string = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        allowed = string if "string" in kinds[column] else False
        allowed = allowed or ("integer" in kinds[column] and pa.types.is_integer(kind))
        if not allowed:
            raise TaskError(f"{path}: column {column!r} has type {kind}; it must be a {kinds[column]} column")
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


def read_rows(
    path: Path | str, optional: dict[str, str]
) -> tuple[Path, bytes, list[tuple[int, dict[str, Any]]]]:
    """(path, bytes, numbered rows) of a Parquet or JSONL task file, bounded and parsed; TaskError naming the
    problem. `optional`: the columns besides prompt and answer a Parquet file may have, and their kind
    ("string", "integer" or "string or integer")."""
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
    with path.open("rb") as f:  # never more than the limit, whatever the file grew to since stat()
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise TaskError(f"task file {path} is more than the limit of {MAX_FILE_BYTES} bytes")
    if suffix in PARQUET_SUFFIXES:
        numbered = list(enumerate(_parquet_rows(path, data, optional), start=1))
    else:
        numbered = _jsonl_rows(path, data)
    if not numbered:
        raise TaskError(f"task file {path} has no rows")
    return path, data, numbered


def load_task_file(path: Path | str) -> FileEnvironment:
    """Read and fully check a Parquet or JSONL task file; raise TaskError naming the first problem."""
    path, data, numbered = read_rows(path, {"task_type": "string", "metadata": "string"})
    tasks = [_check_row(path, row, values) for row, values in numbered]
    return FileEnvironment(path, tasks, hashlib.sha256(data).hexdigest())
