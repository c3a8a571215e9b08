"""Environments the swarm is tested on end to end, beyond the built-in arithmetic: three reasoning-gym families
with short prompts and short answers (the tiny model's completions are scored by each family's own
`score_answer`), and a code task file of short programs that a briefly warm-started tiny model writes, so that
its completions run in the sandbox on the node and again on the validator.

The code file is generated, not stored: six kinds of problem (four with stdin/stdout tests, two with assert
tests), each prompt text always asking for the same program, with tests drawn per row. 60 steps of supervised
training on the file's reference programs (node/models/env_warmstart.py) make the untrained tiny model write
them (about 30 s of CPU); sampling at temperature 1 then gives a mix of passing and failing programs.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from prime_node.node.environments import open_environment
from prime_node.node.models.env_warmstart import EnvWarmStartConfig, train
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.node.models.warmstart import deterministic_torch

# Families whose questions fit the tiny model's 512 positions with room for an answer, and whose answers are
# a few characters (tests/test_reasoning_gym.py opens each).
FAMILIES = {
    "spell_backward": "reasoning_gym:family=spell_backward,max_word_len=5",
    "count_bits": "reasoning_gym:family=count_bits,max_n=255",
    "chain_sum": "reasoning_gym:family=chain_sum,max_digits=1,max_terms=3",
}
CODE_WARM_START_STEPS = 60
CODE_MAX_NEW_TOKENS = 64  # the longest reference program in its fence is 51 characters


def _io(stdin: str, stdout: str) -> dict[str, str]:
    return {"stdin": stdin + "\n", "stdout": stdout + "\n"}


def _kinds(rng: random.Random) -> list[tuple[str, str, Callable[[], object]]]:
    def word() -> str:
        return "".join(rng.choice("abcxyz") for _ in range(rng.randint(1, 6)))

    def number() -> int:
        return rng.randint(-99, 99)

    def echo() -> object:
        w = word()
        return _io(w, w)

    def reverse() -> object:
        w = word()
        return _io(w, w[::-1])

    def upper() -> object:
        w = word()
        return _io(w, w.upper())

    def add() -> object:
        a, b = number(), number()
        return _io(f"{a} {b}", str(a + b))

    def double() -> object:
        a = number()
        return f"assert f({a})=={2 * a}"

    def backwards() -> object:
        w = word()
        return f"assert g({w!r})=={w[::-1]!r}"

    return [
        ("Print the input line.", "print(input())", echo),
        ("Print the input line reversed.", "print(input()[::-1])", reverse),
        ("Print the input line in upper case.", "print(input().upper())", upper),
        ("Read two integers; print their sum.", "print(sum(map(int,input().split())))", add),
        ("Define f(x) returning 2*x.", "def f(x):return 2*x", double),
        ("Define g(s) returning s reversed.", "def g(s):return s[::-1]", backwards),
    ]


def write_code_tasks(path: Path, rows: int = 1200, seed: int = 0) -> Path:
    """A JSONL code task file of `rows` short problems with reference solutions; `path`."""
    rng = random.Random(seed)
    kinds = _kinds(rng)
    lines = []
    for n in range(rows):
        prompt, solution, test = kinds[n % len(kinds)]
        lines.append(json.dumps({"prompt": prompt, "tests": [test(), test()], "solution": solution}))
    path.write_text("\n".join(lines) + "\n")
    return path


def code_model(directory: Path, spec: str, steps: int = CODE_WARM_START_STEPS) -> Path:
    """The tiny model (seed 0) trained `steps` steps on the reference programs of the code environment `spec`,
    saved as a checkpoint directory; `directory`."""
    model, tokenizer = build_tiny_model(0)
    config = EnvWarmStartConfig(steps=steps, batch_size=16, warmup_steps=10, heldout_fraction=0.01)
    with deterministic_torch(1):
        train(model, tokenizer, open_environment(spec), config)
    save_model_dir(model, tokenizer, directory)
    return directory
