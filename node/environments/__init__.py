"""Task environments (environment.py: the interface; registry.py: `--env NAME[:ARGS]` through entry points),
the built-in ones (arithmetic, file), the verifiers that score them, and what every role does with them."""

from __future__ import annotations

from pydantic import ValidationError

from ...p2p.wire import parse_uint
from ..errors import TaskError
from .arithmetic import LEVELS, MAX_SEED, ArithmeticConfig, ArithmeticEnvironment
from .environment import Environment, EnvironmentIdentity, ScoringLimits
from .files import FileEnvironment, load_task_file
from .registry import DEFAULT_ENV, open_environment, parse_spec
from .types import Task
from .verifier import VERIFIERS, get_verifier, register_verifier, score

# The `--tasks` spelling of the built-in family, from before environments (run.tasks still takes it).
BUILTIN_TASKS = "builtin:arithmetic"

__all__ = [
    "BUILTIN_TASKS",
    "DEFAULT_ENV",
    "VERIFIERS",
    "ArithmeticConfig",
    "ArithmeticEnvironment",
    "Environment",
    "EnvironmentIdentity",
    "FileEnvironment",
    "ScoringLimits",
    "Task",
    "get_verifier",
    "load_task_file",
    "open_environment",
    "parse_spec",
    "register_verifier",
    "score",
    "spec_of_tasks",
]


def _builtin_options(spec: str) -> str:
    """`builtin:arithmetic[?levels=3,3,2,1,1][&size=N][&seed=S]` as arithmetic's ARGS."""
    _, _, query = spec.partition("?")
    options: list[str] = []
    try:
        for item in filter(None, query.split("&")):
            key, sep, value = item.partition("=")
            if not sep or key not in ("levels", "size", "seed"):
                raise ValueError(f"unknown parameter {key!r}")
            if key == "levels":
                weights = tuple(parse_uint(v, "a level weight", maximum=MAX_SEED) for v in value.split(","))
                if len(weights) != len(LEVELS):
                    raise ValueError(f"levels needs {len(LEVELS)} weights (levels 1..5), got {len(weights)}")
                ArithmeticConfig(level_weights=weights)
                value = "/".join(str(w) for w in weights)
            else:
                ArithmeticConfig.model_validate({key: parse_uint(value, key, maximum=MAX_SEED)})
            options.append(f"{key}={value}")
        return ",".join(options)
    except ValidationError as exc:
        problem = "; ".join(f"{err['loc'][0]}: {err['msg']}" for err in exc.errors())
    except ValueError as exc:
        problem = str(exc)
    usage = f"{BUILTIN_TASKS}?levels=3,3,2,1,1&size=N&seed=S"
    raise TaskError(f"bad built-in task spec {spec!r}: {problem}; use {usage}")


def spec_of_tasks(tasks: str | None) -> str:
    """The environment spec of a `--tasks` value: None or `builtin:arithmetic[?...]` is the arithmetic
    environment, anything else a task file (`file:PATH`)."""
    if tasks is None or tasks == BUILTIN_TASKS or tasks.startswith(BUILTIN_TASKS + "?"):
        options = _builtin_options(tasks or BUILTIN_TASKS)
        return DEFAULT_ENV + (f":{options}" if options else "")
    return f"file:{tasks}"
