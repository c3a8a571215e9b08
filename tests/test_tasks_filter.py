"""`prime-node tasks filter` on the tiny model: estimates are real, the band is applied, the output loads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from prime_node.node.cli.main import main
from prime_node.node.engine import load_engine
from prime_node.node.environments import VERIFIERS, load_task_file, open_environment, register_verifier
from prime_node.node.environments.difficulty import estimate_pass_rates, sample_seed

from support.attack import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _even_length(completion: str, answer: str) -> float:
    # An untrained model never solves arithmetic; this verifier gives each task a pass rate between 0 and 1
    # that depends on the sampled completions, so the band has something to cut.
    return 1.0 if len(completion) % 2 == 0 else 0.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("filter") / "ckpt")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    assert main(["tasks", "filter", *argv, "--json", "--threads", "1", "--log-level", "WARNING"]) == 0
    return json.loads(capsys.readouterr().out)


def test_filter_builtin_keeps_all_in_full_band_and_is_deterministic(checkpoint, capsys, tmp_path):
    out_a, out_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    common = [
        "--model",
        str(checkpoint),
        "--limit",
        "5",
        "--offset",
        "3",
        "--k",
        "3",
        "--max-new-tokens",
        "12",
    ]
    summary = _run(capsys, *common, "--min", "0", "--max", "1", "--out", str(out_a))
    assert summary["estimated"] == summary["kept"] == 5
    assert sum(summary["histogram"].values()) == 5
    _run(capsys, *common, "--min", "0", "--max", "1", "--out", str(out_b))
    assert out_a.read_bytes() == out_b.read_bytes()  # seeded sampling: same estimates every time
    loaded, source = load_task_file(out_a), open_environment("arithmetic")

    # The file loader knows no difficulty levels, so compare what a run uses.
    def triple(t):
        return (t.prompt, t.answer, t.task_type)

    assert [triple(loaded.get(i)) for i in range(5)] == [triple(source.get(i)) for i in range(3, 8)]


@pytest.fixture
def even_length_verifier() -> Iterator[None]:
    """Registered for this test only: the registry is global, and other tests probe every verifier in it
    with inputs this one is not meant for (test_tasks.py, wrong types)."""
    register_verifier("even_length_test", _even_length)
    try:
        yield
    finally:
        VERIFIERS.pop("even_length_test", None)


def test_filter_band_matches_direct_estimates(checkpoint, capsys, tmp_path, even_length_verifier):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a), "task_type": "even_length_test"}) + "\n"
            for a in range(8)
        )
    )
    out = tmp_path / "kept.parquet"
    summary = _run(
        capsys,
        "--model",
        str(checkpoint),
        "--tasks",
        str(tasks),
        "--k",
        "4",
        "--min",
        "0.25",
        "--max",
        "0.5",
        "--max-new-tokens",
        "10",
        "--seed",
        "5",
        "--out",
        str(out),
    )
    # The same estimates, computed here without the CLI, one task per engine call (batching must not matter).
    engine = load_engine(checkpoint, threads=1)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    environment = load_task_file(tasks)
    direct = estimate_pass_rates(
        engine, tokenizer, environment, list(range(8)), k=4, max_new_tokens=10, seed=5, tasks_per_batch=1
    )
    expected = [e.task for e in direct if 0.25 <= e.pass_rate <= 0.5]
    assert summary["estimated"] == 8 and summary["kept"] == len(expected)
    assert summary["histogram"] == {f"{c}/4": sum(e.passes == c for e in direct) for c in range(5)}
    assert 0 < len(expected) < 8, "the test verifier should leave tasks on both sides of the band"
    kept = load_task_file(out)
    assert [kept.get(i) for i in range(len(kept))] == expected
    assert sample_seed(5, 0, 0) != sample_seed(5, 0, 1) != sample_seed(5, 1, 0)


def test_filter_refuses_empty_band_and_unbounded_builtin(checkpoint, capsys, tmp_path):
    base = [
        "tasks",
        "filter",
        "--model",
        str(checkpoint),
        "--out",
        str(tmp_path / "x.jsonl"),
        "--threads",
        "1",
    ]
    assert main([*base]) == 1  # the built-in set has 2^24 tasks: --limit is needed
    assert "--limit" in capsys.readouterr().err
    # An untrained model solves no arithmetic, so a band above 0 keeps nothing: refused, no file written.
    assert (
        main([*base, "--limit", "2", "--k", "2", "--min", "0.5", "--max", "1", "--max-new-tokens", "4"]) == 1
    )
    assert "widen" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
