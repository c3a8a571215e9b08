"""Mathematics scored by symbolic equivalence with HF's `math-verify` (PyPI `math-verify`).

    --env math:problems.jsonl

A completion's answer is what math-verify extracts from it: the last `\\boxed{...}` when there is one (boxes
joined by commas are one answer, a set), else the last LaTeX or plain expression (`$\\frac{3}{4}$`, `0.75`,
`3/4`); the reference is the row's `answer`, read as if it were boxed. Reward 1.0 when the two are
equivalent (fractions, decimals to 6 places, LaTeX, expressions, intervals, sets: math-verify's `verify`),
else 0.0. Scoring runs in the bounded scorer's worker (scoring.py): math-verify's own signal-based timeouts
are off (they work only on a main thread), the worker's limits are the one bound.

Task files are NuminaMath-style JSONL or Parquet rows with a `problem` (or `prompt`) and an `answer`; the
prompt is the problem verbatim (a chat model's system prompt can ask for `\\boxed{}`). Task files of the
`file` environment name this scorer with task type `math` (`score_task`). The identity pins math-verify's
version; its content hash covers the file's bytes, this module's scheme and the scoring limits.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ...p2p.signing import canonical_json
from ..errors import TaskError
from .environment import EnvironmentIdentity, ScoringLimits
from .files import JSONL_SUFFIXES, MAX_FILE_BYTES, MAX_ROWS, PARQUET_SUFFIXES, _jsonl_rows
from .registry import path_arg, split_args
from .types import MAX_ANSWER_CHARS, MAX_PROMPT_CHARS, Task, check_index
from .verifier import MAX_COMPLETION_CHARS

NAME = "math"
PACKAGE = "math-verify"
TASK_TYPE = "math"
SCHEME = "prime-node/math/v1"  # bumped whenever extraction or scoring here changes: it is in the hash
LIMITS = ScoringLimits(isolation="process", wall_s=5.0, cpu_s=5.0, memory_mb=1024)
PROMPT_COLUMNS = ("problem", "prompt")

# It warns once that its timeouts are off, which is deliberate here (see the module docstring).
logging.getLogger("math_verify").setLevel(logging.ERROR)


def score_math(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer is equivalent to `answer`, else 0.0; never raises."""
    if (
        not isinstance(completion, str)
        or not isinstance(answer, str)
        or len(completion) > MAX_COMPLETION_CHARS
    ):
        return 0.0
    try:
        from math_verify import parse, verify

        gold = parse("\\boxed{" + answer + "}", parsing_timeout=None)
        if not gold:
            return 0.0
        predicted = parse(completion, parsing_timeout=None)
        if not predicted:
            return 0.0
        return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0
    except Exception:  # noqa: BLE001 (sympy on a peer's text can raise anything; that is a 0)
        return 0.0


def score_task(completion: str, task: Task) -> float:
    """The scorer of task type `math` in task files (verifier.py dispatches to it)."""
    return score_math(completion, task.answer)


def _rows(path: Path, data: bytes) -> list[tuple[int, dict[str, Any]]]:
    if path.suffix.lower() in JSONL_SUFFIXES:
        return _jsonl_rows(path, data)
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        columns = [c for c in (*PROMPT_COLUMNS, "answer") if c in parquet.schema_arrow.names]
        if parquet.metadata.num_rows > MAX_ROWS:
            raise TaskError(f"{path}: {parquet.metadata.num_rows} rows, more than the limit of {MAX_ROWS}")
        return list(enumerate(parquet.read(columns=columns).to_pylist(), start=1))
    except (pa.ArrowException, OSError) as exc:
        raise TaskError(f"{path}: not a readable Parquet file ({exc})") from None


def load_math_tasks(path: Path) -> tuple[list[Task], str]:
    """Every row of a math task file checked, and the file's SHA-256; TaskError naming the row and column."""
    if not path.is_file():
        raise TaskError(f"math task file {path} does not exist or is not a file")
    if path.suffix.lower() not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        raise TaskError(f"math task file {path}: use one of {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise TaskError(f"math task file {path} is larger than the limit of {MAX_FILE_BYTES} bytes")
    data = path.read_bytes()[: MAX_FILE_BYTES + 1]
    tasks = []
    for row, values in _rows(path, data):
        where = f"{path}: row {row}"
        prompt = next((values[c] for c in PROMPT_COLUMNS if values.get(c) is not None), None)
        answer = values.get("answer")
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = json.dumps(answer)  # {"answer": 0.5} is as good as {"answer": "0.5"}
        if not isinstance(prompt, str) or not 1 <= len(prompt) <= MAX_PROMPT_CHARS:
            raise TaskError(
                f"{where}: column 'problem' (or 'prompt') must be text of 1..{MAX_PROMPT_CHARS} characters"
            )
        if not isinstance(answer, str) or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
            raise TaskError(f"{where}: column 'answer' must be text of 1..{MAX_ANSWER_CHARS} characters")
        tasks.append(Task(prompt=prompt, answer=answer.strip(), task_type=TASK_TYPE))
    if not tasks:
        raise TaskError(f"math task file {path} has no rows")
    return tasks, hashlib.sha256(data).hexdigest()


class MathEnvironment:
    """Problems from a task file scored by math-verify. Pickled (for the scoring worker) without its tasks:
    scoring needs only the task it is given."""

    def __init__(self, path: Path, tasks: list[Task], sha256: str) -> None:
        self.path = path
        self.sha256 = sha256
        self._tasks = tasks
        document = {"scheme": SCHEME, "file_sha256": sha256, "limits": LIMITS.model_dump()}
        self._identity = EnvironmentIdentity(
            name=NAME,
            package=PACKAGE,
            version=importlib.metadata.version(PACKAGE),
            content_hash="sha256:" + hashlib.sha256(canonical_json(document)).hexdigest(),
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "_tasks": [], "_identity": self._identity}

    @property
    def spec(self) -> str:
        return f"{NAME}:{path_arg(NAME, self.path)}"

    @property
    def identity(self) -> EnvironmentIdentity:
        return self._identity

    @property
    def scoring(self) -> ScoringLimits:
        return LIMITS

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, index: int) -> Task:
        check_index(index, len(self._tasks), self.path)
        return self._tasks[index]

    def warm_up(self) -> None:
        """math-verify's imports and its LaTeX grammar, built once in the scoring worker before any score."""
        score_math("\\boxed{0.5}", "\\frac{1}{2}")

    def score(self, completion: str, task: Task) -> float:
        return score_math(completion, task.answer)


def open_math(args: str, *, seed: int = 0) -> MathEnvironment:
    """Mathematics problems from a JSONL/Parquet file, scored by symbolic equivalence (math-verify)."""
    value = split_args(NAME, args, positional="path", known=["path"]).get("path")
    if value is None:
        raise TaskError(f"{NAME}: give the task file, as {NAME}:FILE")
    path = Path(value).expanduser()
    tasks, sha256 = load_math_tasks(path)
    return MathEnvironment(path, tasks, sha256)
