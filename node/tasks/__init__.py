"""Task sets (the built-in arithmetic family and local task files) and the verifiers that score them."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from ...p2p.wire import parse_uint
from ..errors import TaskError
from .arithmetic import LEVELS, MAX_SEED, ArithmeticConfig, ArithmeticTaskSet
from .files import FileTaskSet, load_task_file
from .types import Task, TaskSet
from .verifier import VERIFIERS, get_verifier, register_verifier, score

BUILTIN_TASKS = "builtin:arithmetic"

__all__ = [
    "BUILTIN_TASKS",
    "VERIFIERS",
    "ArithmeticConfig",
    "ArithmeticTaskSet",
    "FileTaskSet",
    "Task",
    "TaskSet",
    "get_verifier",
    "load_task_file",
    "open_task_set",
    "register_verifier",
    "score",
]


def _builtin_config(spec: str, seed: int) -> ArithmeticConfig:
    """`builtin:arithmetic[?levels=3,3,2,1,1][&size=N][&seed=S]`, the form ArithmeticTaskSet.name prints."""
    _, _, query = spec.partition("?")
    fields: dict[str, object] = {"seed": seed}
    try:
        for item in filter(None, query.split("&")):
            key, sep, value = item.partition("=")
            if not sep or key not in ("levels", "size", "seed"):
                raise ValueError(f"unknown parameter {key!r}")
            if key == "levels":
                weights = tuple(parse_uint(v, "a level weight", maximum=MAX_SEED) for v in value.split(","))
                if len(weights) != len(LEVELS):
                    raise ValueError(f"levels needs {len(LEVELS)} weights (levels 1..5), got {len(weights)}")
                fields["level_weights"] = weights
            else:
                fields[key] = parse_uint(value, key, maximum=MAX_SEED)
        return ArithmeticConfig.model_validate(fields)
    except ValidationError as exc:
        problem = "; ".join(f"{err['loc'][0]}: {err['msg']}" for err in exc.errors())
    except ValueError as exc:
        problem = str(exc)
    usage = f"{BUILTIN_TASKS}?levels=3,3,2,1,1&size=N&seed=S"
    raise TaskError(f"bad built-in task spec {spec!r}: {problem}; use {usage}")


def open_task_set(tasks: str | Path | None, *, seed: int = 0) -> TaskSet:
    """The run's task set: the built-in family (None or "builtin:arithmetic[?...]") or a local file."""
    if tasks is None or str(tasks) == BUILTIN_TASKS or str(tasks).startswith(BUILTIN_TASKS + "?"):
        return ArithmeticTaskSet(_builtin_config(str(tasks or BUILTIN_TASKS), seed))
    return load_task_file(Path(tasks))
