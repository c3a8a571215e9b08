"""reasoning-gym as an environment (node/environments/reasoning_gym.py): strict specs, an identity that
covers the installed version and the whole configuration, tasks that are the same in every process, and
the families' own scorers run in the bounded scorer's worker."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import reasoning_gym

from prime_node.node.environments.reasoning_gym import (
    NONDETERMINISTIC_FAMILIES,
    ReasoningGymEnvironment,
    open_reasoning_gym,
)
from prime_node.node.environments.scoring import BoundedScorer
from prime_node.node.errors import TaskError

# Families the tiny character-level model could plausibly learn: short prompts, short answers, few symbols.
TINY_FAMILIES = {
    "spell_backward": "max_word_len=5",
    "count_bits": "max_n=255",
    "chain_sum": "max_digits=1,max_terms=3",
    "letter_counting": "min_words=1,max_words=3",
    "gcd": "max_value=50",
}
MIX = "families=spell_backward*2/count_bits/chain_sum,chain_sum.max_digits=1,spell_backward.max_word_len=5"


def _spec(family: str) -> str:
    return f"family={family},{TINY_FAMILIES[family]}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("", "exactly one of family=NAME or families="),
        ("family=spell_backward,families=gcd", "exactly one of"),
        ("family=no_such_family", "no family 'no_such_family'"),
        ("family=spell_backward,max_len=3", "family 'spell_backward' has no option 'max_len'"),
        ("families=gcd*0/lcm", "weight of 'gcd' must be an integer"),
        ("families=gcd/gcd", "listed twice"),
        ("families=gcd/lcm,max_value=9", "names no listed family"),
        ("family=word_ladder", "differ between processes"),
        ("family=composite", "families=A*2/B instead"),
        ("family=gcd,max_value=1/2", "takes one value"),
        ("family=gcd,max_value=$(rm)", "plain word"),
        ("family=gcd,min_value=50,max_value=10", "refuses its options"),
        ("family=propositional_logic", "no single reference answer"),
        ("family=gcd,seed=-1", "seed must be in"),
        ("family=gcd,nonsense", "not key=value"),
    ],
)
def test_bad_specs_are_refused_naming_the_part(args: str, message: str) -> None:
    with pytest.raises(TaskError, match=re.escape(message)):
        open_reasoning_gym(args, seed=0)


def test_identity_pins_the_installed_version_and_the_whole_configuration() -> None:
    env = open_reasoning_gym(_spec("spell_backward"), seed=1)
    # The distribution's version, not the module's own __version__ (which 0.1.25 leaves at 0.1.19).
    assert env.identity.package == "reasoning-gym"
    assert env.identity.version == importlib.metadata.version("reasoning-gym") == "0.1.25"
    assert reasoning_gym.__version__ != env.identity.version
    assert open_reasoning_gym(_spec("spell_backward"), seed=1).identity == env.identity
    # The spec reopens exactly this environment.
    assert open_reasoning_gym(env.spec.partition(":")[2]).identity == env.identity
    others = [
        open_reasoning_gym("family=spell_backward,max_word_len=6", seed=1),  # another option value
        open_reasoning_gym(_spec("spell_backward"), seed=2),  # another seed
        open_reasoning_gym(_spec("spell_backward") + ",size=1000", seed=1),  # another size
        open_reasoning_gym(f"families=spell_backward*2/gcd,spell_backward.{TINY_FAMILIES['spell_backward']}"),
        open_reasoning_gym(f"families=spell_backward*3/gcd,spell_backward.{TINY_FAMILIES['spell_backward']}"),
    ]
    hashes = {env.identity.content_hash} | {o.identity.content_hash for o in others}
    assert len(hashes) == 1 + len(others)
    # Defaults are in the hash: naming a default explicitly is the same configuration.
    default = open_reasoning_gym("family=spell_backward", seed=1)
    explicit = open_reasoning_gym("family=spell_backward,max_word_len=10", seed=1)
    assert default.identity == explicit.identity


_TASKS_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    from prime_node.node.environments.reasoning_gym import open_reasoning_gym
    count, order, specs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    for spec in specs:
        env = open_reasoning_gym(spec, seed=5)
        indices = range(count) if order == "forward" else reversed(range(count))
        tasks = {i: env.get(i).model_dump() for i in indices}
        body = json.dumps([tasks[i] for i in range(count)], sort_keys=True).encode()
        print(env.identity.content_hash, hashlib.sha256(body).hexdigest())
    """
)


def _tasks_in_a_process(specs: list[str], count: int, hash_seed: str, order: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", _TASKS_SCRIPT, str(count), order, *specs],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=True,
    )
    return out.stdout.strip().splitlines()[-len(specs) :]


def test_tasks_are_the_same_in_every_process_whatever_the_hash_seed_and_order() -> None:
    specs = [*(_spec(f) for f in TINY_FAMILIES), MIX]
    count = 40
    here = []
    for spec in specs:
        env = open_reasoning_gym(spec, seed=5)
        body = json.dumps([env.get(i).model_dump() for i in range(count)], sort_keys=True).encode()
        here.append(f"{env.identity.content_hash} {hashlib.sha256(body).hexdigest()}")
    assert _tasks_in_a_process(specs, count, "1", "forward") == here
    assert _tasks_in_a_process(specs, count, "2", "reversed") == here


_RAW_SCRIPT = textwrap.dedent(
    """
    import hashlib, io, json, sys, contextlib, warnings
    warnings.filterwarnings("ignore")
    import reasoning_gym
    from reasoning_gym.factory import DATASETS
    names = sys.argv[1].split(",") if sys.argv[1] else sorted(n for n in DATASETS if n != "composite")
    out = {}
    for name in names:
        with contextlib.redirect_stdout(io.StringIO()):
            ds = reasoning_gym.create_dataset(name, seed=42, size=1000)
            entries = [ds[i] for i in range(int(sys.argv[2]))]
        out[name] = hashlib.sha256(json.dumps(entries, sort_keys=True, default=repr).encode()).hexdigest()
    print(json.dumps(out))
    """
)


def _raw_entries(names: str, count: int, hash_seed: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", _RAW_SCRIPT, names, str(count)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_refused_families_do_differ_between_processes() -> None:
    """The check above would catch a nondeterministic family: the refused ones fail it."""
    names = ",".join(sorted(NONDETERMINISTIC_FAMILIES - {"knight_swap", "codeio"}))  # the two slow ones
    one, two = _raw_entries(names, 12, "1"), _raw_entries(names, 12, "2")
    assert all(one[name] != two[name] for name in one), {n: one[n] == two[n] for n in one}


@pytest.mark.slow
def test_every_family_not_refused_is_the_same_in_every_process() -> None:
    """All of reasoning-gym's families, generated under two hash seeds: exactly the refused ones differ."""
    one, two = _raw_entries("", 8, "1"), _raw_entries("", 8, "3")
    differing = {name for name in one if one[name] != two[name]}
    assert differing <= NONDETERMINISTIC_FAMILIES, differing - NONDETERMINISTIC_FAMILIES


def test_real_families_score_their_answers_in_the_bounded_worker() -> None:
    envs: list[ReasoningGymEnvironment] = [open_reasoning_gym(_spec(f), seed=3) for f in TINY_FAMILIES]
    envs.append(open_reasoning_gym(MIX, seed=3))
    # rearc's entries hold tuples its scorer compares by type; knights_knaves's hold what JSON cannot, so
    # their scorer regenerates the entry from its index: both paths must give the family's own reward.
    envs.append(open_reasoning_gym("family=rearc", seed=3))
    envs.append(open_reasoning_gym("family=knights_knaves", seed=3))
    with BoundedScorer(envs[0].scoring) as scorer:
        for env in envs:
            for index in range(4):
                task = env.get(index)
                right = [task.answer, f"Thinking... <answer>{task.answer}</answer>", f"  {task.answer}\n"]
                for completion in right:
                    assert scorer.score(env, completion, task) == 1.0, (env.spec, index, completion)
                for completion in ["", "   ", "<answer></answer>", "<answer> </answer>"]:
                    assert scorer.score(env, completion, task) == 0.0, (env.spec, index, completion)
                assert scorer.score(env, "no idea", task) < 1.0
                # Some families give partial credit (similarity, containment) or accept extra words: the
                # bounded score is exactly the family's own.
                others = [
                    "no idea",
                    "<answer>" * 1000,
                    task.answer + " because it is obvious",
                    "x" + task.answer,
                ]
                for completion in others:
                    assert scorer.score(env, completion, task) == env.score(completion, task), (
                        env.spec,
                        index,
                    )
        assert not scorer.breaches
