"""The built-in arithmetic family, the verifiers and the task-file loader."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prime_node.node.environments import (
    ArithmeticConfig,
    ArithmeticEnvironment,
    Environment,
    Task,
    get_verifier,
    load_task_file,
    open_environment,
    register_verifier,
    score,
    spec_of_tasks,
)
from prime_node.node.environments.verifier import (
    VERIFIERS,
    final_answer,
    integer_match,
    parse_integer,
    text_match,
)
from prime_node.node.errors import TaskError


def _evaluate(expression: str) -> int:
    """Independent reference: Python's own parser on the expression (operands are non-negative ints)."""
    tree = ast.parse(expression, mode="eval")
    return int(eval(compile(tree, "<task>", "eval"), {"__builtins__": {}}))  # noqa: S307 - our own text


def test_same_seed_and_index_give_the_same_problem() -> None:
    a = ArithmeticEnvironment(ArithmeticConfig(seed=7))
    b = ArithmeticEnvironment(ArithmeticConfig(seed=7))
    forward = [a.get(i) for i in range(300)]
    backward = [b.get(i) for i in reversed(range(300))][::-1]
    assert forward == backward  # order of access does not matter
    assert a.get(12_345_678) == b.get(12_345_678)


def test_different_seeds_and_indices_differ() -> None:
    a = ArithmeticEnvironment(ArithmeticConfig(seed=1))
    b = ArithmeticEnvironment(ArithmeticConfig(seed=2))
    pairs = [(a.get(i).prompt, b.get(i).prompt) for i in range(200)]
    assert sum(x != y for x, y in pairs) > 180
    assert len({a.get(i).prompt for i in range(200)}) > 150


def test_known_problems_are_stable_across_versions() -> None:
    # Pinned values: a change here changes every run's task set and must be a deliberate format bump.
    tasks = ArithmeticEnvironment(ArithmeticConfig(seed=1, level_weights=(3, 3, 2, 1, 1)))
    assert [(t.prompt, t.answer, t.difficulty) for t in (tasks.get(0), tasks.get(1), tasks.get(10))] == [
        ("8-3=", "5", 1),
        ("95-14=", "81", 2),
        ("6-2*0=", "6", 4),
    ]


def test_answers_are_correct_and_all_levels_appear() -> None:
    tasks = ArithmeticEnvironment(ArithmeticConfig(seed=3, level_weights=(1, 1, 1, 1, 1)))
    seen = set()
    for i in range(2000):
        task = tasks.get(i)
        assert task.prompt.endswith("=") and task.task_type == "arithmetic"
        assert int(task.answer) == _evaluate(task.prompt[:-1]), task
        assert len(task.prompt) + len(task.answer) <= 16  # short: one token per character
        seen.add(task.difficulty)
        assert integer_match(task.answer, task.answer) == 1.0
    assert seen == {1, 2, 3, 4, 5}
    assert {"+", "-", "*", "("} <= set("".join(tasks.get(i).prompt for i in range(200)))


def test_level_weights_select_levels() -> None:
    only_one = ArithmeticEnvironment(ArithmeticConfig(seed=0, level_weights=(0, 0, 0, 1, 0)))
    assert {only_one.get(i).difficulty for i in range(100)} == {4}
    with pytest.raises(ValueError, match="positive sum"):
        ArithmeticConfig(level_weights=(0, 0, 0, 0, 0))


def test_index_out_of_range_is_a_task_error() -> None:
    tasks = ArithmeticEnvironment(ArithmeticConfig(size=10))
    assert isinstance(tasks, Environment) and len(tasks) == 10
    for bad in (-1, 10, True, 1.0):
        with pytest.raises(TaskError, match="out of range"):
            tasks.get(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("46", "46", 1.0),
        ("  46 \n", "46", 1.0),
        ("046", "46", 1.0),
        ("+046", "46", 1.0),
        ("-0", "0", 1.0),
        ("+0", "-0", 1.0),
        ("-12", "-12", 1.0),
        ("-0012", "-12", 1.0),
        ("12", "-12", 0.0),
        ("4 6", "46", 0.0),
        ("46.0", "46", 0.0),
        ("0x2e", "46", 0.0),
        ("1e2", "100", 0.0),
        ("--46", "46", 0.0),
        ("", "0", 0.0),
        ("   ", "0", 0.0),
        ("=", "0", 0.0),
        ("abc", "46", 0.0),
        ("<eos>", "46", 0.0),
        ("٤٦", "46", 0.0),  # Arabic-Indic digits: int() would accept them, the verifier must not
        ("４６", "46", 0.0),  # full-width digits
        ("46\x00", "46", 0.0),
        ("thinking 2+2=4 so 40+6=46", "46", 1.0),  # working before the final '='
        ("=46 and then 7", "46", 0.0),
        ("46=", "46", 0.0),  # nothing after the last '='
        ("0" * 60_000 + "46", "46", 1.0),  # leading zeros beyond int()'s 4300-digit limit
        ("9" * 300, "9" * 300, 0.0),  # longer than the integer limit: 0, not an exception
        ("9" * 200, "9" * 200, 1.0),
        ("7" * 70_000, "7", 0.0),  # longer than any completion a verifier reads
        ("46", "not a number", 0.0),
    ],
)
def test_integer_verifier_edge_cases(completion: str, answer: str, reward: float) -> None:
    assert integer_match(completion, answer) == reward
    assert score("arithmetic", completion, answer) == reward


def test_verifiers_never_raise_on_wrong_types() -> None:
    for verifier in VERIFIERS.values():
        assert verifier(None, "1") == 0.0  # type: ignore[arg-type]
        assert verifier(b"1", "1") == 0.0  # type: ignore[arg-type]
        assert verifier("1", None) == 0.0  # type: ignore[arg-type]


def test_parse_helpers() -> None:
    assert final_answer("a = b = 12 ") == "12"
    assert final_answer("12") == "12"
    assert parse_integer("-0007") == -7
    assert parse_integer("") is None and parse_integer("+") is None and parse_integer("1_000") is None


def test_text_verifier_and_registry() -> None:
    assert text_match("  Paris ", "Paris") == 1.0
    assert text_match("so the answer = New   York", "New York") == 1.0
    assert text_match("paris", "Paris") == 0.0
    assert text_match("", "  ") == 0.0
    assert get_verifier("exact") is text_match
    with pytest.raises(TaskError, match="no verifier for task type 'nope'; known task types: arithmetic"):
        get_verifier("nope")
    with pytest.raises(TaskError, match="already registered"):
        register_verifier("exact", integer_match)
    with pytest.raises(TaskError, match="lower-case"):
        register_verifier("Bad Name", integer_match)
    register_verifier("test_always_one", lambda completion, answer: 1.0)
    try:
        assert score("test_always_one", "x", "y") == 1.0
    finally:
        VERIFIERS.pop("test_always_one")


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_task_file_loads(tmp_path: Path) -> None:
    rows = [
        {"prompt": "2+2=", "answer": "4", "task_type": "arithmetic", "source": "extra columns are ignored"},
        {"prompt": "Capital of France?", "answer": "Paris"},
        {"prompt": "3*3=", "answer": 9, "task_type": "integer"},
    ]
    path = _write_jsonl(tmp_path / "tasks.jsonl", rows)
    tasks = load_task_file(path)
    assert isinstance(tasks, Environment) and len(tasks) == 3
    assert tasks.get(0) == Task(prompt="2+2=", answer="4", task_type="arithmetic")
    assert tasks.get(1).task_type == "exact"  # the default for files
    assert tasks.get(2).answer == "9"
    assert tasks.identity.content_hash == f"sha256:{tasks.sha256}" and tasks.spec == f"file:{path}"
    assert open_environment(f"file:{path}").get(1).answer == "Paris"
    assert open_environment(spec_of_tasks(str(path))).get(1).answer == "Paris"  # the --tasks shorthand
    assert open_environment("arithmetic", seed=5).get(0) == ArithmeticEnvironment(
        ArithmeticConfig(seed=5)
    ).get(0)
    with pytest.raises(TaskError, match="out of range"):
        tasks.get(3)


def test_parquet_task_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "tasks.parquet"
    table = pa.table({"prompt": ["1+1=", "9-3="], "answer": [2, 6], "task_type": ["arithmetic", None]})
    pq.write_table(table, path)
    tasks = load_task_file(path)
    assert [(t.prompt, t.answer, t.task_type) for t in (tasks.get(0), tasks.get(1))] == [
        ("1+1=", "2", "arithmetic"),
        ("9-3=", "6", "exact"),
    ]


def test_task_file_errors_name_file_row_and_column(tmp_path: Path) -> None:
    good = {"prompt": "1+1=", "answer": "2"}
    cases: list[tuple[list[object], str]] = [
        ([good, {"prompt": "2+2="}], r"tasks.jsonl: row 2: column 'answer' is missing or null"),
        ([good, good, {"answer": "1"}], r"tasks.jsonl: row 3: column 'prompt' is missing or null"),
        ([good, {"prompt": 5, "answer": "5"}], r"row 2: column 'prompt' must be a string, got int"),
        (
            [{"prompt": "x", "answer": [1]}],
            r"row 1: column 'answer' must be a string or an integer, got list",
        ),
        (
            [{"prompt": "x", "answer": True}],
            r"row 1: column 'answer' must be a string or an integer, got bool",
        ),
        (
            [{"prompt": "x", "answer": "1", "task_type": 3}],
            r"row 1: column 'task_type' must be a string, got int",
        ),
        (
            [{"prompt": "x", "answer": "1", "task_type": "poetry"}],
            r"row 1: column 'task_type' is 'poetry', which has no",
        ),
        (
            [{"prompt": "x", "answer": "one", "task_type": "arithmetic"}],
            r"row 1: column 'answer' is 'one', not an integer",
        ),
        ([{"prompt": "", "answer": "1"}], r"row 1: column 'prompt' must have 1\.\.16384 characters, got 0"),
        (
            [{"prompt": "x" * 20_000, "answer": "1"}],
            r"row 1: column 'prompt' must have 1\.\.16384 characters",
        ),
        (
            [{"prompt": "x", "answer": "  "}],
            r"row 1: column 'answer' must have 1\.\.1024 characters and not be blank",
        ),
        ([good, ["1+1=", "2"]], r"row 2: expected a JSON object, got list"),
        ([], r"has no rows"),
    ]
    for rows, message in cases:
        path = _write_jsonl(tmp_path / "tasks.jsonl", rows)
        with pytest.raises(TaskError, match=message):
            load_task_file(path)
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(good) + "\n\n{not json\n")
    with pytest.raises(TaskError, match=r"tasks.jsonl: row 3: not valid JSON"):
        load_task_file(path)


def test_parquet_errors(tmp_path: Path) -> None:
    path = tmp_path / "tasks.parquet"
    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), path)
    with pytest.raises(
        TaskError, match=r"tasks.parquet: missing column 'prompt' \(columns: answer, question\)"
    ):
        load_task_file(path)
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": [2.0]}), path)
    with pytest.raises(
        TaskError, match=r"column 'answer' has type double; it must be a string or integer column"
    ):
        load_task_file(path)
    pq.write_table(pa.table({"prompt": ["1+1=", None], "answer": ["2", "3"]}), path)
    with pytest.raises(TaskError, match=r"tasks.parquet: row 2: column 'prompt' is missing or null"):
        load_task_file(path)
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(TaskError, match=r"tasks.parquet: not a readable Parquet file"):
        load_task_file(path)


def test_task_file_path_and_format_errors(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"missing.jsonl does not exist"):
        load_task_file(tmp_path / "missing.jsonl")
    csv = tmp_path / "tasks.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(TaskError, match=r"tasks.csv: unknown format '.csv'; use one of .parquet"):
        load_task_file(csv)


def test_builtin_spec_selects_levels_and_round_trips_its_name() -> None:
    easy = open_environment(spec_of_tasks("builtin:arithmetic?levels=1,0,0,0,0&size=50"), seed=9)
    assert len(easy) == 50 and {easy.get(i).difficulty for i in range(50)} == {1}
    assert easy.spec == "arithmetic:seed=9,size=50,levels=1/0/0/0/0"
    again = open_environment(easy.spec, seed=0)  # the seed in the spec wins over the argument
    assert [again.get(i) for i in range(50)] == [easy.get(i) for i in range(50)]
    for bad, why in [
        ("builtin:arithmetic?levels=1,2", "levels needs 5 weights"),
        ("builtin:arithmetic?levels=0,0,0,0,0", "positive sum"),
        ("builtin:arithmetic?colour=red", "unknown parameter 'colour'"),
        ("builtin:arithmetic?size=0", "size"),
        ("builtin:arithmetic?seed=x", "seed 'x' is not a number in ASCII digits"),
        ("builtin:arithmetic?seed=\u0661", "is not a number in ASCII digits"),  # int() read it as 1
        ("builtin:arithmetic?size=+5", "size '\\+5' is not a number"),  # int() took the sign
        ("builtin:arithmetic?levels=1,1,1,1,1_0", "a level weight '1_0' is not a number"),
    ]:
        with pytest.raises(TaskError, match=f"bad built-in task spec.*{why}"):
            spec_of_tasks(bad)
