"""Mathematics with math-verify (node/environments/math.py): real symbolic equivalences, task files checked
row by row, and scoring in the bounded scorer's worker equal to the scorer itself."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prime_node.node.environments.math import open_math, score_math, score_task
from prime_node.node.environments.scoring import BoundedScorer
from prime_node.node.environments.types import Task
from prime_node.node.errors import TaskError

EQUIVALENT = [
    # fractions
    (r"The answer is \boxed{\frac{1}{2}}", "1/2"),
    ("so x = 1/2", r"\frac12"),
    (r"$\dfrac{6}{8}$", r"\frac{3}{4}"),
    # decimals against fractions, percentages
    ("0.25", "1/4"),
    (r"The final answer is $\dfrac{3}{4}$.", "0.75"),
    (r"\boxed{50\%}", "0.5"),
    # LaTeX forms of one value or expression
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2"),
    (r"\boxed{2\pi}", r"\pi \cdot 2"),
    (r"\boxed{(1,2)}", "(1, 2)"),
    # the final answer is the last one
    (r"\boxed{2} hmm no wait \boxed{3}", "3"),
    ("First 2, then the answer is 3", "3"),
    ("-7", "-7"),
]
NOT_EQUIVALENT = [
    (r"\boxed{0.6}", "1/2"),
    (r"\boxed{2} hmm no wait \boxed{3}", "2"),
    (r"\boxed{2}, \boxed{3}", "3"),  # boxes joined by a comma are one answer, the set {2, 3}
    ("1 2 3 4 5 6 7 8 9 10", "7"),  # listing candidates does not earn the one in the middle
    (r"\boxed{x^2+1}", "(x+1)^2"),
    ("7", "-7"),
    ("I do not know", "2"),
    ("", "2"),
    ("1" * 70_000, "1" * 70_000),  # beyond the completion bound: not looked at
]


@pytest.mark.parametrize(("completion", "answer"), EQUIVALENT)
def test_equivalent_answers_score_one(completion: str, answer: str) -> None:
    assert score_math(completion, answer) == 1.0


@pytest.mark.parametrize(("completion", "answer"), NOT_EQUIVALENT)
def test_other_answers_score_zero(completion: str, answer: str) -> None:
    assert score_math(completion, answer) == 0.0


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_task_files_load_and_score_in_the_bounded_worker(tmp_path: Path) -> None:
    rows = [
        {"problem": "What is 1/2 + 1/4?", "answer": r"\frac{3}{4}", "solution": "ignored"},
        {"problem": "Simplify 6/8.", "answer": 0.75},
        {"prompt": "What is sqrt(8)?", "answer": r"2\sqrt{2}"},
    ]
    env = open_math(f"path={_jsonl(tmp_path / 'numina.jsonl', rows)}")
    assert len(env) == 3 and env.get(1).answer == "0.75" and env.get(2).prompt == "What is sqrt(8)?"
    table = pa.table({"problem": ["What is 1/2 + 1/4?"], "answer": [r"\frac{3}{4}"]})
    pq.write_table(table, tmp_path / "numina.parquet")
    assert open_math(f"path={tmp_path / 'numina.parquet'}").get(0) == env.get(0)
    completions = [r"\boxed{0.75}", r"$\frac{6}{8}$", r"\boxed{\sqrt{8}}", r"\boxed{1}", "hmm"]
    with BoundedScorer(env.scoring) as scorer:
        for index in range(3):
            task = env.get(index)
            bounded = [scorer.score(env, c, task) for c in completions]
            assert (
                bounded
                == [env.score(c, task) for c in completions]
                == [score_task(c, task) for c in completions]
            )
        assert [scorer.score(env, c, env.get(0)) for c in completions] == [1.0, 1.0, 0.0, 0.0, 0.0]
        assert [scorer.score(env, c, env.get(2)) for c in completions] == [0.0, 0.0, 1.0, 0.0, 0.0]
        assert not scorer.breaches


def test_the_identity_covers_the_file_bytes(tmp_path: Path) -> None:
    rows = [{"problem": "1+1?", "answer": "2"}]
    one = open_math(f"path={_jsonl(tmp_path / 'a.jsonl', rows)}")
    same = open_math(f"path={_jsonl(tmp_path / 'b.jsonl', rows)}")  # another path, the same bytes
    other = open_math(f"path={_jsonl(tmp_path / 'c.jsonl', [{'problem': '1+1?', 'answer': '3'}])}")
    assert one.identity == same.identity != other.identity
    assert one.identity.package == "math-verify" and one.identity.version == "0.9.0"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"answer": "2"}], "row 1: column 'problem'"),
        ([{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?"}], "row 2: column 'answer'"),
        ([{"problem": "1+1?", "answer": " "}], "row 1: column 'answer'"),
        ([{"problem": "", "answer": "2"}], "row 1: column 'problem'"),
        ([], "has no rows"),
    ],
)
def test_bad_task_files_are_refused_naming_row_and_column(
    tmp_path: Path, rows: list[dict[str, object]], message: str
) -> None:
    with pytest.raises(TaskError, match=message):
        open_math(f"path={_jsonl(tmp_path / 'bad.jsonl', rows)}")


def test_bad_specs_are_refused() -> None:
    with pytest.raises(TaskError, match="math: unknown option 'file' \\(known: path\\)"):
        open_math("file=x.jsonl", seed=0)
    with pytest.raises(TaskError, match="math: give the task file, as math:FILE"):
        open_math("", seed=0)
    with pytest.raises(TaskError, match="does not exist"):
        open_math("path=/nonexistent/x.jsonl", seed=0)
    task = Task(prompt="p", answer="2", task_type="math")
    assert score_task(r"\boxed{2}", task) == 1.0
