"""Code tasks: the model writes a Python program, the sandbox runs it against the task's unit tests.

A code task file is JSONL or Parquet, one task a row:
- `prompt` (string): the problem statement. The environment appends one fixed instruction asking for the
  program in a ```python block, so that every peer builds the same prompt.
- `tests`: a JSON array (in Parquet also a string column holding one) of either
  - stdin/stdout pairs, `{"stdin": "3 4\\n", "stdout": "7\\n"}`: the program reads the input and must print
    the output (compared line by line, trailing whitespace and trailing blank lines ignored); or
  - Python test snippets, `"assert add(3, 4) == 7"`: the program is run as a module named `solution`
    (so an `if __name__ == "__main__":` block does not run), then each snippet in its namespace.
- `solution` (optional string): a reference program; the task's answer is then that program in a
  ```python block, so that the answer earns full reward. `task_type` (optional) must be "code".

The program is the last complete ```python fenced block of the completion (an opening line ```python,
a closing line ```), nothing else: no block, an unterminated block or an empty one scores 0, as does a
completion over MAX_COMPLETION_CHARS. Every run is one `run_sandboxed` call with the environment's limits.

Reward ("all" by default): 1 when every test passes, else 0. Partial credit ("fraction", the share of tests
passed) rewards programs that special-case some tests (printing the most common answer, say) over ones
that try the whole problem, and costs a run per test even for a program that fails the first; all-or-
nothing is what a judge gives and stops at the first failure. Both are deterministic given the program's
own determinism (see docs/environments.md, "Sandbox", for what is pinned: hash seed, environment, limits).

Snippet tests run in one process, after the program, and a program can defeat them (exit with status 0
before they run is caught by a marker the harness prints last; returning an object whose == is always true
is not). stdin/stdout tests cannot be gamed that way: the expected output never enters the sandbox. Prefer
them for anything a reward must be trusted with.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ...p2p.signing import canonical_json
from .. import __version__
from ..errors import TaskError
from .environment import EnvironmentIdentity, ScoringLimits
from .files import JSONL_SUFFIXES, MAX_FILE_BYTES, MAX_ROWS, PARQUET_SUFFIXES, _jsonl_rows
from .registry import path_arg, split_args
from .sandbox import (
    SANDBOX_VERSION,
    START_MARGIN_S,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    check_sandbox,
    run_sandboxed,
)
from .types import MAX_ANSWER_CHARS, MAX_METADATA_CHARS, MAX_PROMPT_CHARS, Task, check_index
from .verifier import MAX_COMPLETION_CHARS

log = logging.getLogger(__name__)

NAME = "code"
TASK_TYPE = "code"
# Bump when prompts, extraction, harness or comparison change: part of the identity.
CODE_FORMAT = 1
MAX_TESTS = 64
MAX_PROGRAM_BYTES = 32 * 1024
NO_SOLUTION = "(no reference solution)"
_FENCE_OPEN = "```python"
_FENCE_CLOSE = "```"
_INSTRUCTIONS = {
    "io": (
        "\n\nWrite a complete Python 3 program (standard library only) that reads the input from standard "
        "input and prints the answer to standard output. Put the whole program in one ```python code block "
        "at the end of your answer."
    ),
    "assert": (
        "\n\nWrite the Python 3 code (standard library only) that solves this. Put all of it in one "
        "```python code block at the end of your answer; it is run as a module and then checked with tests."
    ),
}


class IoTest(BaseModel):
    """One stdin/stdout test."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    stdin: str = Field(..., max_length=MAX_METADATA_CHARS, description="Standard input of the program.")
    stdout: str = Field(..., max_length=MAX_METADATA_CHARS, description="Expected standard output.")


class CodeTests(BaseModel):
    """A code task's tests, as the task's metadata carries them (canonical JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: Literal["io", "assert"] = Field(..., description="stdin/stdout pairs or Python test snippets.")
    tests: tuple[IoTest, ...] | tuple[str, ...] = Field(
        ..., min_length=1, max_length=MAX_TESTS, description="The tests, all of the one kind."
    )

    @model_validator(mode="after")
    def _one_kind(self) -> CodeTests:
        want = IoTest if self.kind == "io" else str
        if not all(isinstance(test, want) for test in self.tests):
            raise ValueError(f"tests of kind {self.kind!r} must all be {want.__name__}")
        return self


class CodeConfig(BaseModel):
    """How programs are run and rewarded (all of it in the environment's identity)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reward: Literal["all", "fraction"] = Field(
        "all", description="1 only when every test passes, or the share of tests passed."
    )
    limits: SandboxLimits = Field(SandboxLimits(), description="Limits of each sandboxed run.")


def extract_program(completion: str) -> str | None:
    """The last complete ```python block of `completion`, or None (linear in its length, bounded)."""
    if not isinstance(completion, str) or len(completion) > MAX_COMPLETION_CHARS:
        return None
    found: str | None = None
    block: list[str] | None = None
    for line in completion.split("\n"):
        marker = line.strip()
        if block is None:
            if marker == _FENCE_OPEN:
                block = []
        elif marker == _FENCE_CLOSE:
            found, block = "\n".join(block) + "\n", None
        else:
            block.append(line)
    if found is None or not found.strip():
        return None
    try:
        size = len(found.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate (valid in JSON, not in a source file)
        return None
    return found if size <= MAX_PROGRAM_BYTES else None


def _lines(output: bytes | str) -> list[str] | None:
    """Output as compared: lines without trailing whitespace, trailing blank lines dropped; None if not UTF-8."""
    if isinstance(output, bytes):
        try:
            output = output.decode("utf-8")
        except UnicodeDecodeError:
            return None
    lines = [line.rstrip() for line in output.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _harness(program: str, snippets: tuple[str, ...]) -> tuple[str, str]:
    """A program running `program` as module `solution`, then each snippet in a copy of its namespace,
    printing a marker and one 0/1 per snippet last; and that marker (fixed by program and tests)."""
    digest = hashlib.sha256(canonical_json({"program": program, "tests": list(snippets)})).hexdigest()
    marker = f"prime-node-tests-{digest[:32]}"
    source = (
        "import sys, traceback\n"
        f"_tests = {snippets!r}\n"
        "_namespace = {'__name__': 'solution', '__builtins__': __builtins__}\n"
        "try:\n"
        f"    exec(compile({program!r}, 'solution.py', 'exec'), _namespace)\n"
        "except BaseException:\n"
        "    traceback.print_exc()\n"
        "    _results = '0' * len(_tests)\n"
        "else:\n"
        "    _results = ''\n"
        "    for _test in _tests:\n"
        "        try:\n"
        "            exec(compile(_test, 'test.py', 'exec'), dict(_namespace))\n"
        "        except BaseException:\n"
        "            traceback.print_exc()\n"
        "            _results += '0'\n"
        "        else:\n"
        "            _results += '1'\n"
        f"print('\\n{marker}', _results, flush=True)\n"
    )
    return source, marker


def _passed(program: str, tests: CodeTests, config: CodeConfig) -> tuple[int, int]:
    """(tests passed, tests run); with reward "all", running stops at the first failure."""
    if tests.kind == "assert":
        snippets = tuple(str(t) for t in tests.tests)
        source, marker = _harness(program, snippets)
        result = run_sandboxed(source, b"", config.limits)
        lines = _lines(result.stdout) or [""]
        name, _, bits = lines[-1].partition(" ")
        if not result.ok or name != marker or len(bits) != len(snippets) or set(bits) - {"0", "1"}:
            return 0, len(snippets)
        return bits.count("1"), len(snippets)
    passed = 0
    for number, test in enumerate(tests.tests, start=1):
        assert isinstance(test, IoTest)
        result = run_sandboxed(program, test.stdin.encode("utf-8", "surrogatepass"), config.limits)
        if result.ok and _lines(result.stdout) == _lines(test.stdout):
            passed += 1
        elif config.reward == "all":
            return passed, number
    return passed, len(tests.tests)


def score_code(completion: str, task: Task, config: CodeConfig | None = None) -> float:
    """The reward of `completion` on the code task `task` (its metadata holds the tests); never raises."""
    config = config or CodeConfig()
    try:
        program = extract_program(completion)
        if program is None:
            return 0.0
        tests = CodeTests.model_validate_json(task.metadata)
        passed, _ = _passed(program, tests, config)
        if config.reward == "all":
            return 1.0 if passed == len(tests.tests) else 0.0
        return passed / len(tests.tests)
    except (SandboxError, ValidationError, ValueError, OSError) as exc:
        # A task or a sandbox that cannot run: the environment checked both at start, so this is the host
        # in trouble (out of processes or memory), not the completion; it still scores 0 as the rule says.
        log.error("code task could not be scored (reward 0): %s", exc)
        return 0.0
    except Exception:
        log.exception("code task could not be scored (reward 0)")
        return 0.0


class CodeEnvironment:
    """The tasks of one code task file, scored by running their tests in the sandbox.

    Refuses to start (SandboxUnavailable, naming the reason and the fix) where no sandbox works: a code
    environment without one would run peers' programs with the operator's rights.
    """

    def __init__(self, path: Path | str, config: CodeConfig | None = None) -> None:
        self.config = config or CodeConfig()
        try:
            check_sandbox()
        except SandboxUnavailable as exc:
            raise SandboxUnavailable(f"the code environment cannot start: {exc}") from None
        self.path = Path(path).expanduser()
        self._tasks, self.sha256 = load_code_tasks(self.path)
        runs = max(len(CodeTests.model_validate_json(t.metadata).tests) for t in self._tasks)
        limits = self.config.limits
        wall = min(600.0, runs * (limits.wall_s + START_MARGIN_S) + 10.0)
        # The scorer itself only waits on the sandbox, but a worker's limits are inherited by the sandbox,
        # whose launcher can lower them, never raise them: they must not be below the sandbox's own.
        self._scoring = ScoringLimits(
            isolation="sandbox",
            wall_s=wall,
            cpu_s=min(600.0, max(wall, limits.cpu_s + 1.0)),
            memory_mb=min(65536, max(1024, limits.memory_mb + 256)),
        )
        hashed = {
            "format": CODE_FORMAT,
            "file_sha256": self.sha256,
            "config": self.config.model_dump(mode="json"),
            "sandbox": SANDBOX_VERSION,
        }
        self._identity = EnvironmentIdentity(
            name=NAME,
            package="prime-node",
            version=__version__,
            content_hash="sha256:" + hashlib.sha256(canonical_json(hashed)).hexdigest(),
        )

    @property
    def spec(self) -> str:
        defaults = CodeConfig()
        options = [path_arg(NAME, self.path)]
        if self.config.reward != defaults.reward:
            options.append(f"reward={self.config.reward}")
        options += [
            f"{key}={value}" for key, value in self.config.limits.model_dump(exclude_defaults=True).items()
        ]
        return f"{NAME}:" + ",".join(options)

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
        return score_code(completion, task, self.config)


def open_code_environment(args: str, seed: int = 0) -> CodeEnvironment:
    """`code:PATH[,reward=all|fraction,wall_s=4,cpu_s=2,...]` (any SandboxLimits field); `seed` is unused:
    the file fixes the tasks."""
    del seed
    known = ["path", "reward", *SandboxLimits.model_fields]
    items = split_args(NAME, args, positional="path", known=known)
    path = items.pop("path", None)
    if path is None:
        raise TaskError(f"{NAME}: the task file's path is missing; use {_USAGE}")
    before, mark, after = path.partition("?")
    if mark and "=" in after:  # the spelling before one grammar served every environment
        raise TaskError(
            f"{NAME}: {'?' + after[:60]!r}: options follow the path after ',' now: "
            f"{NAME}:{before},{after.replace('&', ',')[:60]}"
        )
    reward = items.pop("reward", None)
    try:
        limits = SandboxLimits.model_validate(items)
        config = CodeConfig.model_validate({**({"reward": reward} if reward else {}), "limits": limits})
    except ValidationError as exc:
        problem = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise TaskError(f"{NAME}: {problem}") from None
    return CodeEnvironment(path, config)


_USAGE = "code:PATH[,reward=all|fraction,wall_s=S,cpu_s=S,memory_mb=M,...]"


def load_code_tasks(path: Path) -> tuple[list[Task], str]:
    """Read and fully check a code task file: its tasks and the SHA-256 of its bytes; TaskError naming
    the file, row and column of the first problem."""
    if not path.is_file():
        raise TaskError(f"code task file {path} does not exist or is not a file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise TaskError(f"code task file {path} is {size} bytes, more than the limit of {MAX_FILE_BYTES}")
    suffix = path.suffix.lower()
    if suffix not in PARQUET_SUFFIXES + JSONL_SUFFIXES:
        allowed = ", ".join(PARQUET_SUFFIXES + JSONL_SUFFIXES)
        raise TaskError(
            f"code task file {path}: unknown format {suffix or '(no suffix)'!r}; use one of {allowed}"
        )
    data = path.read_bytes()[: MAX_FILE_BYTES + 1]
    if suffix in PARQUET_SUFFIXES:
        numbered = list(enumerate(_parquet_rows(path, data), start=1))
    else:
        numbered = _jsonl_rows(path, data)
    if not numbered:
        raise TaskError(f"code task file {path} has no rows")
    tasks = [code_task(f"{path}: row {row}", values) for row, values in numbered]
    return tasks, hashlib.sha256(data).hexdigest()


def _parquet_rows(path: Path, data: bytes) -> list[dict[str, Any]]:
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        if parquet.metadata.num_rows > MAX_ROWS:
            raise TaskError(f"{path}: {parquet.metadata.num_rows} rows, more than the limit of {MAX_ROWS}")
        names = set(parquet.schema_arrow.names)
        wanted = [c for c in ("prompt", "tests", "solution", "task_type") if c in names]
        return parquet.read(columns=wanted).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise TaskError(f"{path}: not a readable Parquet file ({exc})") from None


def code_task(where: str, values: dict[str, Any]) -> Task:
    """One row (`prompt`, `tests`, optional `solution` and `task_type`) as a Task; TaskError naming `where`
    and the column. Other environments with code rows (task_type "code") build their tasks here too."""
    prompt, tests, solution = values.get("prompt"), values.get("tests"), values.get("solution")
    task_type = values.get("task_type") or TASK_TYPE
    if task_type != TASK_TYPE:
        raise TaskError(
            f"{where}: column 'task_type' is {str(task_type)[:80]!r}; code tasks have {TASK_TYPE!r}"
        )
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskError(f"{where}: column 'prompt' must be a non-empty string")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as exc:
            raise TaskError(f"{where}: column 'tests' is a string but not JSON ({exc})") from None
    if not isinstance(tests, list) or not tests:
        raise TaskError(f"{where}: column 'tests' must be a non-empty list of tests")
    kind = "assert" if all(isinstance(t, str) for t in tests) else "io"
    try:
        checked = CodeTests.model_validate({"kind": kind, "tests": tuple(tests)})
    except ValidationError as exc:
        first = exc.errors()[0]
        # the location without pydantic's union branch names ("tuple[IoTest, ...]"): item 3.stdout
        at = ".".join(str(p) for p in first["loc"][1:] if isinstance(p, int) or str(p).isidentifier())
        raise TaskError(
            f"{where}: column 'tests'{' item ' + at if at else ''}: {first['msg']} (each test is "
            '{"stdin": "...", "stdout": "..."} or a string of Python, all of one kind, '
            f"1..{MAX_TESTS} of them)"
        ) from None
    text = prompt + _INSTRUCTIONS[kind]
    if len(text) > MAX_PROMPT_CHARS:
        raise TaskError(
            f"{where}: column 'prompt' is too long ({len(prompt)} characters with the instruction)"
        )
    answer = NO_SOLUTION
    if solution is not None:
        if not isinstance(solution, str) or not solution.strip():
            raise TaskError(f"{where}: column 'solution' must be a non-empty string when present")
        answer = f"{_FENCE_OPEN}\n{solution.rstrip()}\n{_FENCE_CLOSE}"
        if len(answer) > MAX_ANSWER_CHARS:
            raise TaskError(
                f"{where}: column 'solution' is longer than a task's answer may be ({MAX_ANSWER_CHARS} characters)"
            )
    metadata = canonical_json(checked.model_dump(mode="json")).decode("utf-8")
    if len(metadata) > MAX_METADATA_CHARS:
        raise TaskError(f"{where}: column 'tests' is larger than {MAX_METADATA_CHARS} characters")
    return Task(prompt=text, answer=answer, task_type=TASK_TYPE, metadata=metadata)
