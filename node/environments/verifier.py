"""Reward verifiers: completion text + reference answer -> 1.0 or 0.0, never an exception.

Completions may show working before the answer (the length reward asks for thinking tokens), so the final
answer is the text after the last '=' when there is one, else the whole completion. Verifiers run on text
produced by untrusted nodes and are re-run by validators, so they must be total, cheap and deterministic:
inputs are bounded before any parsing, and only ASCII digits count as digits (Python's int() would accept
Arabic-Indic or full-width digits, which would make "٤٦" score like "46").
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from ..errors import TaskError
from .types import Task

Verifier = Callable[[str, str], float]
TaskScorer = Callable[[str, Task], float]

# Longest completion a verifier looks at; anything longer earns 0 without being scanned further.
MAX_COMPLETION_CHARS = 65_536
# Longest integer (digits) accepted as an answer; far beyond any task here, short enough to stay cheap.
MAX_INTEGER_DIGITS = 256
_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)


def final_answer(completion: str) -> str:
    """The part of a completion that holds its final answer: after the last '=', whitespace stripped."""
    _, _, tail = completion.rpartition("=")
    return tail.strip()


def parse_integer(text: str) -> int | None:
    """An ASCII decimal integer with optional sign and leading zeros ('+046' -> 46), or None."""
    if not _INTEGER.fullmatch(text):
        return None
    digits = text.lstrip("+-").lstrip("0")
    if len(digits) > MAX_INTEGER_DIGITS:
        return None
    # Leading zeros are dropped first: int() refuses strings over 4300 characters, zeros included.
    value = int(digits or "0", 10)
    return -value if text.startswith("-") else value  # '-0' and '+0' both give 0


def integer_match(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer and the reference are the same integer, else 0.0."""
    if (
        not isinstance(completion, str)
        or not isinstance(answer, str)
        or len(completion) > MAX_COMPLETION_CHARS
    ):
        return 0.0
    expected = parse_integer(answer.strip())
    got = parse_integer(final_answer(completion))
    return 1.0 if expected is not None and got is not None and got == expected else 0.0


def _normalise_text(text: str) -> str:
    return " ".join(text.split())


def text_match(completion: str, answer: str) -> float:
    """1.0 when the final answer equals the reference up to surrounding and repeated whitespace."""
    if (
        not isinstance(completion, str)
        or not isinstance(answer, str)
        or len(completion) > MAX_COMPLETION_CHARS
    ):
        return 0.0
    expected = _normalise_text(answer)
    return 1.0 if expected and _normalise_text(final_answer(completion)) == expected else 0.0


# task_type -> verifier. "arithmetic" is the built-in family; file tasks may name either.
VERIFIERS: dict[str, Verifier] = {
    "arithmetic": integer_match,
    "integer": integer_match,
    "exact": text_match,
}


def register_verifier(task_type: str, verifier: Verifier, *, replace: bool = False) -> None:
    """Make `verifier` score tasks of `task_type` (a run's code must register the same on every peer)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", task_type):
        raise TaskError(f"verifier name {task_type!r} must be lower-case letters, digits and '_', at most 64")
    if task_type in VERIFIERS and not replace:
        raise TaskError(f"a verifier for task type {task_type!r} is already registered; pass replace=True")
    VERIFIERS[task_type] = verifier


def get_verifier(task_type: str) -> Verifier:
    try:
        return VERIFIERS[task_type]
    except KeyError:
        known = ", ".join(sorted(VERIFIERS))
        raise TaskError(f"no verifier for task type {task_type!r}; known task types: {known}") from None


def score(task_type: str, completion: str, answer: str) -> float:
    """The reward of `completion` for a task of `task_type` with reference `answer`."""
    return get_verifier(task_type)(completion, answer)


# Task types of task files whose scorer needs the whole task (its metadata: a program's tests) and runs
# outside the scoring process (environment.py, ScoringLimits): task type -> (module, function, isolation).
# The modules are node/environments/math.py and code.py; a task file that names one of these types is refused
# at load where its module is missing, not scored 0 row by row.
EXTERNAL_TASK_TYPES: dict[str, tuple[str, str, str]] = {
    "math": ("prime_node.node.environments.math", "score_task", "process"),
    "code": ("prime_node.node.environments.code", "score_task", "sandbox"),
}


def known_task_types() -> list[str]:
    return sorted({*VERIFIERS, *EXTERNAL_TASK_TYPES})


def task_scorer(task_type: str) -> tuple[TaskScorer, str]:
    """(scorer of a whole task, isolation it needs: inline, process or sandbox) for `task_type`."""
    if task_type in VERIFIERS:
        verifier = VERIFIERS[task_type]
        return (lambda completion, task: verifier(completion, task.answer)), "inline"
    if task_type not in EXTERNAL_TASK_TYPES:
        raise TaskError(
            f"no verifier for task type {task_type!r}; known task types: {', '.join(known_task_types())}"
        )
    module, function, isolation = EXTERNAL_TASK_TYPES[task_type]
    try:
        scorer = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        raise TaskError(
            f"task type {task_type!r} is scored by {module}.{function}, which this install lacks ({exc})"
        ) from None
    return scorer, isolation
