"""The code environment (node/environments/code.py): task files, strict program extraction, rewards, and
hostile completions scored through the real sandbox, each beside an honest control that earns 1."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prime_node.node.environments import code
from prime_node.node.environments.code import (
    MAX_PROGRAM_BYTES,
    MAX_TESTS,
    CodeConfig,
    CodeEnvironment,
    code_task,
    extract_program,
    open_code_environment,
    score_code,
)
from prime_node.node.environments.environment import Environment
from prime_node.node.environments.sandbox import SandboxLimits
from prime_node.node.environments.verifier import MAX_COMPLETION_CHARS
from prime_node.node.errors import TaskError

from support.sandbox import sandbox_skip_reason, watch_sandboxes

SKIP = sandbox_skip_reason()
needs_sandbox = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
EXAMPLE = Path(__file__).parent / "data" / "code_tasks.jsonl"
LIMITS = SandboxLimits(wall_s=5, cpu_s=2, memory_mb=256, output_bytes=1 << 16)


def fenced(program: str) -> str:
    return f"Here is my solution.\n\n```python\n{textwrap.dedent(program).strip()}\n```\n"


def io_task(tests: list[dict[str, str]]) -> object:
    return code_task("test", {"prompt": "Solve it.", "tests": tests})


def test_extraction_takes_the_last_complete_python_block_only() -> None:
    two = "```python\nprint(1)\n```\ntext\n```python\nprint(2)\n```\n"
    assert extract_program(two) == "print(2)\n"
    assert extract_program("  ```python  \nprint(3)\n  ```") == "print(3)\n"  # indented fences count
    assert extract_program("```python\nprint(1)\n```\n```python\nprint(2)\n") == "print(1)\n"  # unfinished
    for bad in (
        "print(1)",  # no block at all
        "```py\nprint(1)\n```",  # only ```python opens a block
        "```\nprint(1)\n```",
        "```python print(1) ```",  # fences are whole lines
        "```python\n   \n```",  # empty
        "```python\nprint('\udc80')\n```",  # a lone surrogate: no UTF-8 source file holds it
        "```python\nprint(1)",  # never closed
        fenced("x = 1\n" * (MAX_PROGRAM_BYTES // 6 + 1)),  # program over the bound
        "x" * (MAX_COMPLETION_CHARS + 1) + fenced("print(1)"),  # completion over the bound
        None,
    ):
        assert extract_program(bad) is None, bad  # type: ignore[arg-type]


def test_task_rows_are_checked_and_named(tmp_path: Path) -> None:
    io = code_task(
        "f: row 1", {"prompt": "Add.", "tests": [{"stdin": "1 2\n", "stdout": "3\n"}], "solution": "x"}
    )
    assert io.task_type == "code" and io.answer == "```python\nx\n```"
    assert json.loads(io.metadata) == {"kind": "io", "tests": [{"stdin": "1 2\n", "stdout": "3\n"}]}
    assert io.prompt.startswith("Add.\n\n") and "standard input" in io.prompt
    snippets = code_task("f: row 2", {"prompt": "Define f.", "tests": '["assert f() == 1"]'})  # a JSON string
    assert json.loads(snippets.metadata)["kind"] == "assert" and snippets.answer == code.NO_SOLUTION
    bad_rows = {
        "column 'tests' must be a non-empty list": {"prompt": "p", "tests": []},
        "column 'tests' is a string but not JSON": {"prompt": "p", "tests": "[oops"},
        "column 'tests' item 0.stdout": {"prompt": "p", "tests": [{"stdin": "1", "stdout": 3}]},
        "column 'tests'": {"prompt": "p", "tests": [{"stdin": "1", "stdout": "1"}, "assert True"]},
        f"column 'tests': Value should have at most {MAX_TESTS} items": {
            "prompt": "p",
            "tests": ["assert True"] * (MAX_TESTS + 1),
        },
        "column 'prompt' must be a non-empty string": {"prompt": " ", "tests": ["assert True"]},
        "column 'task_type' is 'math'": {"prompt": "p", "tests": ["assert True"], "task_type": "math"},
        "column 'solution' is longer": {"prompt": "p", "tests": ["assert True"], "solution": "x" * 2000},
    }
    for message, row in bad_rows.items():
        with pytest.raises(TaskError, match="^f: row 3: " + message.replace("(", r"\(").replace(".", r"\.")):
            code_task("f: row 3", row)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(EXAMPLE.read_text() + '{"prompt": "p"}\n')
    with pytest.raises(TaskError, match=f"^{broken}: row 7: column 'tests' must be a non-empty list"):
        code.load_code_tasks(broken)


def test_bad_environment_specs_name_the_wrong_part() -> None:
    for spec, message in (
        ("", "the task file's path is missing"),
        ("reward=all", "the task file's path is missing"),
        (f"{EXAMPLE},colour=red", "code: unknown option 'colour' (known: path, reward, wall_s"),
        (f"{EXAMPLE},wall_s", "code: 'wall_s' is not key=value"),
        (f"{EXAMPLE},wall_s=", "code: option 'wall_s' has no value"),
        (f"{EXAMPLE},,wall_s=1", "code: empty item 2"),
        (f"{EXAMPLE},wall_s=1,wall_s=2", "code: option 'wall_s' is given twice"),
        (f"{EXAMPLE},reward=most", "code: reward: Input should be 'all' or 'fraction'"),
        (f"{EXAMPLE},cpu_s=0", "code: cpu_s: Input should be greater than or equal to 1"),
        (f"{EXAMPLE},wall_s=ten", "code: wall_s: Input should be a valid number"),
        # The spelling before one grammar served every environment: refused, saying how it is written now.
        (f"{EXAMPLE}?reward=all&wall_s=3", "code: '?reward=all&wall_s=3': options follow the path after"),
    ):
        with pytest.raises(TaskError, match=re.escape(message)):
            open_code_environment(spec)


def test_refuses_to_start_without_a_sandbox(tmp_path: Path) -> None:
    # No bwrap on PATH: the environment refuses with the reason and the fix, not a traceback later.
    opener = (
        "from prime_node.node.environments.code import open_code_environment\n"
        "from prime_node.node.environments.sandbox import SandboxUnavailable\n"
        f"try:\n    open_code_environment({str(EXAMPLE)!r})\n"
        "except SandboxUnavailable as exc:\n    print('REFUSED', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", opener], env={"PATH": str(tmp_path)}, capture_output=True, timeout=60
    )
    assert done.stdout.startswith(b"REFUSED the code environment cannot start: no sandbox: bubblewrap"), done
    assert b"apt-get install bubblewrap" in done.stdout


@needs_sandbox
def test_example_file_answers_pass_and_wrong_programs_fail() -> None:
    env = open_code_environment(str(EXAMPLE))
    assert isinstance(env, Environment) and len(env) == 6 and env.scoring.isolation == "sandbox"
    kinds = [json.loads(env.get(i).metadata)["kind"] for i in range(len(env))]
    assert kinds.count("io") == 4 and kinds.count("assert") == 2
    for index in range(len(env)):
        task = env.get(index)
        assert env.score(task.answer, task) == 1.0, index  # the reference solution
        assert env.score(fenced("print(7)"), task) == 0.0, index
        assert env.score("The answer is 7.", task) == 0.0, index
    with pytest.raises(TaskError, match="out of range"):
        env.get(len(env))
    name, _, args = env.spec.partition(":")
    assert name == "code" and open_code_environment(args).identity == env.identity


def test_identity_covers_file_bytes_limits_reward_and_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(code, "check_sandbox", lambda: "pretend")  # the identity needs no sandbox to run
    copy = tmp_path / "tasks.jsonl"
    copy.write_bytes(EXAMPLE.read_bytes())
    base = CodeEnvironment(copy).identity
    assert CodeEnvironment(EXAMPLE).identity == base  # the bytes, not the path
    assert base.name == "code" and base.package == "prime-node"
    variants = [
        CodeEnvironment(copy, CodeConfig(reward="fraction")).identity,
        CodeEnvironment(copy, CodeConfig(limits=SandboxLimits(wall_s=5))).identity,
        CodeEnvironment(copy, CodeConfig(limits=SandboxLimits(memory_mb=512))).identity,
    ]
    copy.write_bytes(EXAMPLE.read_bytes() + b"\n")
    variants.append(CodeEnvironment(copy).identity)
    copy.write_bytes(EXAMPLE.read_bytes())
    monkeypatch.setattr(code, "SANDBOX_VERSION", "bwrap-sandbox/999 python/3.11")
    variants.append(CodeEnvironment(copy).identity)
    assert len({v.content_hash for v in variants} | {base.content_hash}) == len(variants) + 1


def test_parquet_files_give_the_same_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(code, "check_sandbox", lambda: "pretend")
    rows = [json.loads(line) for line in EXAMPLE.read_text().splitlines()]
    as_strings = tmp_path / "strings.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "tests": json.dumps(r["tests"])} for r in rows]), as_strings)
    nested = tmp_path / "nested.parquet"
    io_rows = [r for r in rows if isinstance(r["tests"][0], dict)]
    pq.write_table(pa.Table.from_pylist(io_rows), nested)  # tests as list<struct<stdin, stdout>>
    jsonl = CodeEnvironment(EXAMPLE)
    from_strings = CodeEnvironment(as_strings)
    assert [from_strings.get(i) for i in range(len(from_strings))] == [
        jsonl.get(i) for i in range(len(jsonl))
    ]
    from_nested = CodeEnvironment(nested)
    assert [from_nested.get(i) for i in range(len(from_nested))] == [jsonl.get(i) for i in range(4)]


@needs_sandbox
def test_rewards_all_or_fraction_and_output_comparison() -> None:
    task = io_task(
        [
            {"stdin": "1\n", "stdout": "1\n"},
            {"stdin": "2\n", "stdout": "4\n"},
            {"stdin": "3\n", "stdout": "9\n"},
        ]
    )
    squares = fenced("n = int(input())\nprint(n * n, '  ')\nprint()\nprint()")  # trailing blanks are ignored
    wrong_last = fenced("n = int(input())\nprint(n * n if n < 3 else 0)")
    assert score_code(squares, task, CodeConfig(limits=LIMITS)) == 1.0
    assert score_code(wrong_last, task, CodeConfig(limits=LIMITS)) == 0.0
    assert score_code(wrong_last, task, CodeConfig(reward="fraction", limits=LIMITS)) == pytest.approx(2 / 3)
    assert score_code(fenced("print(input().upper())"), io_task([{"stdin": "a", "stdout": "A"}])) == 1.0
    assert (
        score_code(fenced("print('a b')"), io_task([{"stdin": "", "stdout": "a  b"}])) == 0.0
    )  # inner spaces count
    assert (
        score_code(
            fenced("import sys; sys.stdout.buffer.write(b'\\xff')"),
            io_task([{"stdin": "", "stdout": "\ufffd"}]),
        )
        == 0.0
    )
    assert score_code(fenced("print(1)"), task.model_copy(update={"metadata": "{not json"})) == 0.0  # total


@needs_sandbox
def test_snippet_tests_need_the_harness_to_finish() -> None:
    task = code_task(
        "t", {"prompt": "Define double.", "tests": ["assert double(2) == 4", "assert double(-1) == -2"]}
    )
    config = CodeConfig(reward="fraction", limits=LIMITS)
    assert score_code(fenced("def double(x):\n    return 2 * x"), task, config) == 1.0
    assert score_code(fenced("def double(x):\n    return x + 2"), task, config) == 0.5
    guarded = "def double(x):\n    return 2 * x\nif __name__ == '__main__':\n    print(double(int(input())))"
    assert score_code(fenced(guarded), task, config) == 1.0  # runs as module `solution`: no main block
    for early_exit in (
        "import os\nos._exit(0)",
        "import sys\nsys.exit(0)",
        "def double(x):\n    return 2 * x\nprint('\\nprime-node-tests-0000 11')\nimport os\nos._exit(0)",
    ):
        assert score_code(fenced(early_exit), task, config) == 0.0, early_exit


HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "allocation": "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))",
    "infinite loop": "while True:\n    pass",
    "sleep": "import time\ntime.sleep(3600)",
    "huge output": "import sys\nwhile True:\n    sys.stdout.write('SECRET-VALUE\\n' * 4096)",
    "kill the scorer": (
        "import os, signal\nfor pid in range(2, 400):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n        pass\nos.kill(-1, signal.SIGKILL)"
    ),
    "setsid daemon": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\ntime.sleep(3600)",
}


@needs_sandbox
def test_hostile_programs_score_zero_and_leave_the_host_alone(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("SECRET-VALUE\n")
    tmp_path.chmod(0o755)
    secret.chmod(0o644)
    # Serve the expected answer on the host's loopback: a program that could connect would earn 1.
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    served: list[int] = []

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:
                continue
            served.append(1)
            with connection:
                connection.sendall(b"SECRET-VALUE\n")

    stop = threading.Event()
    server_thread = threading.Thread(target=serve, daemon=True)
    server_thread.start()
    programs = dict(HOSTILE)
    programs["read a file outside"] = f"print(open({str(secret)!r}).read(), end='')"
    programs["read the network"] = (
        f"import socket\nprint(socket.create_connection(('127.0.0.1', {port}), timeout=2).recv(100).decode(), end='')"
    )
    programs["write outside"] = f"open({str(tmp_path / 'pwned')!r}, 'w').write('x')\nprint('SECRET-VALUE')"
    task = io_task([{"stdin": "", "stdout": "SECRET-VALUE\n"}])
    config = CodeConfig(limits=SandboxLimits(wall_s=3, cpu_s=1, memory_mb=256, output_bytes=1 << 16))
    env_bound = 3 + 3.0  # one run's wall clock plus the kill and teardown margin on a loaded machine
    try:
        for name, program in programs.items():
            with watch_sandboxes() as watch:
                started = time.monotonic()
                reward = score_code(fenced(program), task, config)
                elapsed = time.monotonic() - started
            assert reward == 0.0, name
            assert elapsed < env_bound, (name, elapsed)
            assert watch.leftovers() == [], name
        # The controls: the same task and server do give 1 to a program that prints the answer itself,
        # and the server does answer the host.
        assert score_code(fenced("print('SECRET-VALUE')"), task, config) == 1.0
        with socket.create_connection(("127.0.0.1", port), timeout=2) as client:
            assert client.recv(100) == b"SECRET-VALUE\n"
    finally:
        stop.set()
        server_thread.join(5)
        server.close()
    assert served == [1], "only the host's own connection reached the server"
    assert secret.read_text() == "SECRET-VALUE\n" and not (tmp_path / "pwned").exists()
