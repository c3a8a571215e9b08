"""`prime-node tasks list` and `tasks preview`, and difficulty filtering for every environment: the filter's
output reopens as `filtered:FILE`, those tasks of the source environment scored by it, even where a task file
could not score them on its own."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from prime_node.node.cli.main import main
from prime_node.node.environments import open_environment
from prime_node.node.environments.registry import distribution_version
from prime_node.node.errors import TaskError
from prime_node.node.models.tokenizer import build_char_tokenizer
from prime_node.node.run.validation import RunTasks

from support.attack import make_checkpoint
from support.environments import install_toy_words

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VERSION = distribution_version("prime-node")


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    assert main([*argv, "--json", "--log-level", "WARNING"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tasks-cli") / "ckpt")


def test_tasks_list_shows_every_installed_environment_with_its_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(install_toy_words(tmp_path / "site", toy_gone="toy_words_gone:open")))
    listed = {e["name"]: e for e in _json(capsys, "tasks", "list")["environments"]}
    for name in ("arithmetic", "file", "filtered"):
        assert (listed[name]["package"], listed[name]["version"], listed[name]["conflict"]) == (
            "prime-node",
            VERSION,
            False,
        )
    assert listed["arithmetic"]["summary"].startswith("Procedurally generated integer arithmetic")
    assert (listed["toy_words"]["package"], listed["toy_words"]["version"]) == ("toy-words", "1.2.3")
    assert listed["toy_words"]["summary"] == "Lengths of words (a toy)."
    assert listed["toy_gone"]["summary"].startswith("(cannot be loaded: ModuleNotFoundError")
    assert main(["tasks", "list"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("NAME") and re.search(r"^toy_words +toy-words 1\.2\.3", text, re.MULTILINE), text


def test_tasks_preview_shows_the_identity_tasks_and_their_scores(capsys: pytest.CaptureFixture[str]) -> None:
    spec = "arithmetic:levels=1/0/0/0/0,size=50"
    shown = _json(
        capsys, "tasks", "preview", "--env", spec, "--count", "4", "--offset", "2", "--completion", "=7"
    )
    environment = open_environment(spec)
    assert shown["spec"] == environment.spec and shown["pin"] == environment.identity.pin
    assert shown["tasks"] == 50 and shown["scoring"]["isolation"] == "inline"
    assert [t["index"] for t in shown["preview"]] == [2, 3, 4, 5]
    for item in shown["preview"]:
        task = environment.get(item["index"])
        assert (item["prompt"], item["answer"], item["difficulty"]) == (task.prompt, task.answer, 1)
        assert item["answer_score"] == 1.0  # the scorer accepts its own reference
        assert item["completion_score"] == (1.0 if task.answer == "7" else 0.0)
    assert main(["tasks", "preview", "--env", spec, "--count", "1"]) == 0
    text = capsys.readouterr().out
    assert f"identity     {environment.identity.pin}" in text and "scored inline" in text
    assert main(["tasks", "preview", "--env", "arithmetic:levels=1/2"]) == 1
    assert "prime-node tasks preview: error: arithmetic: levels: needs 5 weights" in capsys.readouterr().err
    assert main(["tasks", "preview", "--env", spec, "--offset", "50"]) == 1
    assert "past the end" in capsys.readouterr().err


def test_filtering_works_for_an_environment_a_task_file_cannot_score(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], checkpoint: Path
) -> None:
    monkeypatch.syspath_prepend(str(install_toy_words(tmp_path / "site")))
    out = tmp_path / "kept.jsonl"
    flags = ["--model", str(checkpoint), "--k", "4", "--max-new-tokens", "6", "--threads", "1"]
    summary = _json(
        capsys,
        "tasks",
        "filter",
        "--env",
        "toy_words:parity",
        *flags,
        "--min",
        "0.25",
        "--max",
        "0.75",
        "--out",
        str(out),
    )
    assert 0 < summary["kept"] < summary["estimated"] == 12, summary  # the band cut something, kept something
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["source"] for r in rows} == {"toy_words:parity"}
    # A task file cannot score a puzzle family's tasks on its own (their scorer is the environment's) ...
    with pytest.raises(TaskError, match="column 'task_type' is 'toy', which has no verifier"):
        open_environment(f"file:{out}")
    # ... the filtered environment can: those tasks of the source, scored by it, pinned as its package.
    source, kept = open_environment("toy_words:parity"), open_environment(f"filtered:{out}")
    assert [kept.get(i) for i in range(len(kept))] == [source.get(r["source_index"]) for r in rows]
    assert (kept.identity.name, kept.identity.package, kept.identity.version) == (
        "toy_words",
        "toy-words",
        "1.2.3",
    )
    assert kept.identity.content_hash != source.identity.content_hash and kept.spec == f"filtered:{out}"
    tasks = RunTasks(kept, build_char_tokenizer())
    assert tasks.scorer("ab", kept.get(0)) == 1.0 and tasks.scorer("abc", kept.get(0)) == 0.0  # the source's
    assert _json(capsys, "tasks", "preview", "--env", f"filtered:{out}")["pin"] == kept.identity.pin

    # Filtering the filtered set again narrows it: its rows name the original source, never a filtered file.
    again = tmp_path / "again.jsonl"
    _json(
        capsys,
        "tasks",
        "filter",
        "--env",
        f"filtered:{out}",
        *flags,
        "--min",
        "0",
        "--max",
        "1",
        "--out",
        str(again),
    )
    again_rows = [json.loads(line) for line in again.read_text().splitlines()]
    assert [(r["source"], r["source_index"]) for r in again_rows] == [
        (r["source"], r["source_index"]) for r in rows
    ]
    assert open_environment(f"filtered:{again}").identity == kept.identity

    # A file that no longer matches its source stops the run at start-up, naming the row.
    def rewritten(change: dict) -> Path:
        path = tmp_path / "bad.jsonl"
        path.write_text(
            "".join(json.dumps({**r, **change} if i == 1 else r) + "\n" for i, r in enumerate(rows))
        )
        return path

    cases = [
        (
            {"prompt": "len(zz)="},
            "row 2: task .* of toy_words:parity has another prompt or answer than the file's",
        ),
        (
            {"source_index": 99},
            "row 2: column 'source_index' must be a task index of toy_words:parity \\(0..11\\)",
        ),
        ({"source": "toy_words:hard"}, "column 'source' must name the one environment"),
        ({"source": f"filtered:{out}"}, "must name the one environment"),
    ]
    for change, message in cases:
        with pytest.raises(TaskError, match=message):
            open_environment(f"filtered:{rewritten(change)}")
    nested = tmp_path / "nested.jsonl"
    nested.write_text("".join(json.dumps({**r, "source": f"filtered:{out}"}) + "\n" for r in rows))
    with pytest.raises(TaskError, match="is itself filtered; name the original environment"):
        open_environment(f"filtered:{nested}")
