"""The environment layer: `--env NAME[:ARGS]` parsed strictly, environments found through entry points (the
built-in ones as prime-node's own, a third party's from its installed metadata), their identities, and
rewards computed through the environment on the one path every role uses (RunTasks)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from prime_node.node.config import load_config
from prime_node.node.environments import (
    ArithmeticConfig,
    ArithmeticEnvironment,
    EnvironmentIdentity,
    ScoringLimits,
    Task,
    load_task_file,
    open_environment,
    parse_spec,
)
from prime_node.node.environments import verifier as verifier_module
from prime_node.node.environments.registry import OWN_DISTRIBUTION, distribution_version, installed
from prime_node.node.errors import ConfigError, TaskError
from prime_node.node.models.tokenizer import build_char_tokenizer
from prime_node.node.run.settings import RolloutSettings, RunSettings, open_run_environment
from prime_node.node.run.validation import RunTasks

from support.environments import distribution, install_toy_words

BAD_SPECS = [
    ("", "got an empty one"),
    ("Arithmetic", "the name 'Arithmetic' must be 1-64 of a-z 0-9 _"),
    ("9lives", "the name '9lives' must be"),
    ("arith metic", "the name 'arith metic' must be"),
    ("arithmetic:", "nothing after ':'"),
    ("arithmetic\n", "unprintable character U\\+000A"),
    ("x" * 5000, "at most 4096"),
    ("nosuchenv", "no environment named 'nosuchenv' is installed; installed: arithmetic, (.*, )?file"),
    ("arithmetic:colour=red", "arithmetic: unknown option 'colour' \\(known: seed, size, levels\\)"),
    ("arithmetic:levels", "arithmetic: 'levels' is not key=value"),
    ("arithmetic:seed=1,seed=2", "option 'seed' is given twice"),
    ("arithmetic:seed=x", "arithmetic: seed: 'x' is not a whole number in ASCII digits"),
    # int() and pydantic read these as numbers; a spec is compared across machines, so only one spelling
    ("arithmetic:seed=\u0661", "arithmetic: seed: '\u0661' is not a whole number in ASCII digits"),
    ("arithmetic:seed=+5", "arithmetic: seed: '\\+5' is not a whole number in ASCII digits"),
    ("arithmetic:size=1_0", "arithmetic: size: '1_0' is not a whole number"),
    ("arithmetic:levels=1/+1/0/0/0", "arithmetic: levels: '\\+1' is not a whole number"),
    ("arithmetic:size=0", "arithmetic: size: Input should be greater than or equal to 1"),
    (
        "arithmetic:levels=1/2",
        "arithmetic: levels: needs 5 weights \\(levels 1..5\\) separated by '/', got 2",
    ),
    ("arithmetic:levels=0/0/0/0/0", "arithmetic: level weights must be integers in \\[0, 1000000\\] with a"),
    ("file", "file: give the task file's path"),
    ("arithmetic:seed=1,", "arithmetic: empty item 2 in 'seed=1,'"),
    ("arithmetic:seed=", "arithmetic: option 'seed' has no value"),
    ("arithmetic:Seed=1", "arithmetic: 'Seed=1' is not key=value"),
    ("file:a.jsonl,b.jsonl", "file: 'b.jsonl' is not key=value \\(known: path\\)"),
    ("file:a.jsonl,path=b.jsonl", "file: option 'path' is given twice"),
    ("file:a.jsonl,seed=1", "file: unknown option 'seed' \\(known: path\\)"),
    ("file:/no/such/tasks.jsonl", "task file /no/such/tasks.jsonl does not exist"),
]


@pytest.mark.parametrize(("spec", "message"), BAD_SPECS)
def test_a_bad_spec_is_refused_naming_the_part_that_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        open_environment(spec)


def test_good_specs_open_and_round_trip() -> None:
    assert parse_spec("arithmetic") == ("arithmetic", "") and parse_spec("file:a:b.jsonl") == (
        "file",
        "a:b.jsonl",
    )
    easy = open_environment("arithmetic:levels=1/0/0/0/0,size=50", seed=9)
    assert len(easy) == 50 and {easy.get(i).difficulty for i in range(50)} == {1}
    assert easy.spec == "arithmetic:seed=9,size=50,levels=1/0/0/0/0"
    again = open_environment(easy.spec, seed=0)  # the spec's seed wins over the default
    assert again.identity == easy.identity and [again.get(i) for i in range(50)] == [
        easy.get(i) for i in range(50)
    ]


def test_the_built_in_environments_are_prime_nodes_own_entry_points() -> None:
    found = installed()
    for name, target in (
        ("arithmetic", "prime_node.node.environments.arithmetic:open_arithmetic"),
        ("file", "prime_node.node.environments.files:open_file"),
    ):
        (entry,) = found[name]
        assert (entry.package, entry.version, entry.target) == (
            OWN_DISTRIBUTION,
            distribution_version(OWN_DISTRIBUTION),
            target,
        )
    assert found["arithmetic"][0].summary().startswith("Procedurally generated integer arithmetic")


def test_a_third_partys_environment_is_found_through_its_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = install_toy_words(
        tmp_path / "site",
        toy_broken="toy_words_plugin:not_an_environment",
        toy_refuses="toy_words_plugin:refuses",
        toy_missing="toy_words_gone:open",
        **{"Bad-Name": "toy_words_plugin:open_words"},
    )
    monkeypatch.syspath_prepend(str(site))
    found = installed()
    assert "Bad-Name" not in found  # not a valid environment name: skipped, with a warning
    words = open_environment("toy_words:hard")
    assert (words.identity.package, words.identity.version, words.spec) == (
        "toy-words",
        "1.2.3",
        "toy_words:hard",
    )
    assert [words.get(i).prompt for i in range(3)] == ["len(a)=", "len(bb)=", "len(ccc)="]
    tasks = RunTasks(words, build_char_tokenizer())
    assert tasks.scorer(" 2 ", words.get(1)) == 1.0 and tasks.scorer("3", words.get(1)) == 0.0
    with pytest.raises(
        TaskError, match="environment 'toy_broken' \\(toy-words 1.2.3\\) returned dict, which is not"
    ):
        open_environment("toy_broken")
    with pytest.raises(
        TaskError, match="environment 'toy_refuses' refused 'toy_refuses': ValueError: no ARGS"
    ):
        open_environment("toy_refuses")
    with pytest.raises(
        TaskError, match="'toy_missing' \\(toy-words 1.2.3, toy_words_gone:open\\) cannot be loaded"
    ):
        open_environment("toy_missing")
    # A second package registering the same name: neither is chosen silently.
    distribution(site, "toy-words-fork", "0.9", {"toy_words": "toy_words_plugin:open_words"})
    with pytest.raises(
        TaskError, match="registered by more than one package: toy-words 1.2.3 .*, toy-words-fork 0.9"
    ):
        open_environment("toy_words")


def test_an_identity_pins_the_configuration_and_the_package() -> None:
    default = ArithmeticEnvironment().identity
    assert default == ArithmeticEnvironment(ArithmeticConfig()).identity  # a pure function of the config
    assert (default.name, default.package, default.version) == (
        "arithmetic",
        "prime-node",
        distribution_version("prime-node"),
    )
    # Pinned: a change here changes every run's identity, and must be a deliberate format change.
    assert default.content_hash == "sha256:ba35829d90f14761e5a109cab4d9027533323c4400ced7cf3afde59fe8ca9493"
    others = [
        ArithmeticConfig(seed=1),
        ArithmeticConfig(size=1000),
        ArithmeticConfig(level_weights=(1, 0, 0, 0, 0)),
    ]
    hashes = {ArithmeticEnvironment(config).identity.content_hash for config in others}
    assert len(hashes) == 3 and default.content_hash not in hashes
    assert default.pin == f"arithmetic prime-node=={default.version} {default.content_hash}"
    with pytest.raises(ValueError, match="package"):
        EnvironmentIdentity(name="x", package="two words", version="1", content_hash=default.content_hash)


class _Scripted:
    """An environment whose scorer returns what it is told (by the completion): to see what RunTasks does
    with a scorer that breaks the interface's promise."""

    spec = "scripted"
    identity = EnvironmentIdentity(
        name="scripted", package="tests", version="0", content_hash="sha256:" + "0" * 64
    )
    scoring = ScoringLimits(isolation="inline")

    def __len__(self) -> int:
        return 1

    def get(self, index: int) -> Task:
        return Task(prompt="say", answer="anything", task_type="scripted")

    def score(self, completion: str, task: Task) -> float:
        if completion == "raise":
            raise RuntimeError("a scorer bug")
        return {"half": 0.5, "nan": math.nan, "big": 1.5, "neg": -0.1, "bool": True, "text": "1"}[completion]


def test_run_tasks_score_through_the_environment_and_hold_it_to_0_1() -> None:
    tokenizer = build_char_tokenizer()
    tasks = RunTasks(_Scripted(), tokenizer)
    ids = tokenizer("half", add_special_tokens=False)["input_ids"]
    assert tasks.rewards_for(0, 7, ids) == (0.5, 0.0, None)  # the environment's own reward, not a verifier's
    for completion in ("nan", "big", "neg", "bool", "text", "raise"):  # each breaks the promise: 0, no crash
        assert tasks.scorer(completion, tasks.environment.get(0)) == 0.0


def test_a_task_file_dispatches_each_task_type_and_takes_the_strictest_isolation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "toy_tests_scorer.py").write_text(
        "import json\n"
        "def score_task(completion, task):\n"
        "    return 1.0 if completion == json.loads(task.metadata)['expect'] else 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(
        verifier_module.EXTERNAL_TASK_TYPES, "toy", ("toy_tests_scorer", "score_task", "process")
    )
    rows = [
        {"prompt": "2+2=", "answer": "4", "task_type": "integer"},
        {"prompt": "say hi", "answer": "x", "task_type": "toy", "metadata": {"expect": "hi", "b": [1]}},
        {"prompt": "say ho", "answer": "x", "task_type": "toy", "metadata": '{"expect": "ho"}'},
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = load_task_file(path)
    assert env.scoring.isolation == "process"  # one row needs a worker: every score goes through one
    assert env.get(1).metadata == '{"b":[1],"expect":"hi"}'  # canonical JSON, whatever the file's spelling
    assert [env.score(c, env.get(i)) for i, c in ((0, "=4"), (1, "hi"), (2, "hi"), (2, "ho"))] == [1, 1, 0, 1]
    assert env.identity.content_hash == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    only_inline = tmp_path / "inline.jsonl"
    only_inline.write_text(json.dumps(rows[0]) + "\n")
    assert load_task_file(only_inline).scoring.isolation == "inline"
    # A task type whose scorer is not installed stops the run at load, naming it.
    monkeypatch.setitem(verifier_module.EXTERNAL_TASK_TYPES, "toy", ("toy_gone", "score_task", "process"))
    with pytest.raises(
        TaskError, match="task type 'toy' is scored by toy_gone.score_task, which this install lacks"
    ):
        load_task_file(path)
    for metadata, why in (
        ("[1]", "must be a JSON object, got list"),
        ("{nope", "is not valid JSON"),
        (7, "must be a JSON object, got int"),
    ):
        path.write_text(json.dumps({"prompt": "p", "answer": "a", "metadata": metadata}) + "\n")
        with pytest.raises(TaskError, match=f"row 1: column 'metadata' {why}"):
            load_task_file(path)


def test_the_run_setting_env_is_checked_at_load_and_opens_the_run_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert RunSettings().env_spec == "arithmetic"
    assert RunSettings(tasks="builtin:arithmetic?size=9").env_spec == "arithmetic:size=9"
    assert RunSettings(tasks="t.jsonl").env_spec == "file:t.jsonl"
    run = RunSettings(env="arithmetic:size=9", task_seed=4)
    assert open_run_environment(run).spec == "arithmetic:seed=4,size=9,levels=3/3/2/1/1"
    monkeypatch.setenv("PRIME_NODE_RUN__ENV", "Arith:size=9")
    with pytest.raises(ConfigError, match="run.env.*the name 'Arith' must be"):
        load_config(RolloutSettings)
    monkeypatch.setenv("PRIME_NODE_RUN__ENV", "arithmetic")
    monkeypatch.setenv("PRIME_NODE_RUN__TASKS", "t.jsonl")
    with pytest.raises(ConfigError, match="set run.env or run.tasks, not both"):
        load_config(RolloutSettings)


def test_options_are_typed_and_a_list_of_one_needs_no_slash() -> None:
    from pydantic import BaseModel

    from prime_node.node.environments.registry import parse_options

    class Words(BaseModel):
        words: list[str] = ["a"]
        weights: tuple[int, ...] | None = None
        limit: int | None = None

    assert parse_options("w", "words=cat,weights=4,limit=3", Words) == Words(
        words=["cat"], weights=(4,), limit=3
    )
    assert parse_options("w", "words=cat/ox", Words).words == ["cat", "ox"]
    assert parse_options("w", "", Words) == Words()
    # '/' separates items only where the option takes a list: elsewhere it is part of the value (a path)
    with pytest.raises(TaskError, match="w: limit: '1/2' is not a whole number"):
        parse_options("w", "limit=1/2", Words)


def test_one_grammar_a_main_argument_bare_or_by_name_and_specs_that_reopen(tmp_path: Path) -> None:
    from prime_node.node.environments.registry import path_arg, split_args

    # NAME[:ARGS], ARGS items key=value separated by ','; a bare first item is the main argument (a path).
    assert split_args("e", "a/b.jsonl,x=1", positional="path") == {"path": "a/b.jsonl", "x": "1"}
    assert split_args("e", "path=a=b.jsonl", positional="path") == {"path": "a=b.jsonl"}
    assert split_args("e", "./a=b.jsonl", positional="path") == {"path": "./a=b.jsonl"}
    assert split_args("e", "chain_sum.max_digits=1,seed=3") == {"chain_sum.max_digits": "1", "seed": "3"}
    # A path that reads as an option is written by name; one holding ',' cannot be in a spec at all.
    assert path_arg("e", "a=b.jsonl") == "path=a=b.jsonl" and path_arg("e", "/t/a=b") == "/t/a=b"
    with pytest.raises(TaskError, match="^e: the path 'a,b' cannot be named in an environment spec"):
        path_arg("e", "a,b")
    rows = [{"prompt": "1+1=", "answer": "2"}]
    (tmp_path / "x=1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for spec in (f"file:{tmp_path}/x=1.jsonl", f"file:path={tmp_path}/x=1.jsonl"):
        env = open_environment(spec)
        assert (
            env.spec == f"file:{tmp_path}/x=1.jsonl" and open_environment(env.spec).identity == env.identity
        )
