"""Single-turn tasksets of the `verifiers` library (PyPI `verifiers`, the optional extra `verifiers`).

    pip install -e '.[verifiers]'
    --env verifiers:taskset=my_taskset[,size=N][,OPTION=VALUE...]

verifiers 0.4 (its `verifiers.v1` stack) loads a taskset by id: an installed module exporting one
`Taskset` subclass, whose `load()` yields `Task`s (a `TaskData` row and `@vf.reward` methods). Here the
taskset's tasks, in `load()` order, are the environment's tasks, and a completion is scored as verifiers
scores a finished rollout: a trace holding the prompt and the completion as the one sampled assistant
message goes through the task's own `score`, and the reward is the weighted mean of its rewards clipped to
[0, 1] (verifiers sums weighted rewards; a run's reward must lie in [0, 1]). OPTIONS are the taskset
config's own fields, validated by its pydantic model; `size` takes the first N tasks (required for a
taskset that never ends).

Supported, because they work offline and in one turn: tasksets of finite (or `size`-bounded) tasks with a
text prompt (a string, or one user message), a reference `answer` field, and rewards that read only the
task and the trace. Refused at open, naming the reason: tasks that need a container (`NEEDS_CONTAINER`),
tool servers (`toolsets`: multi-turn, and their processes are not ours to bound), LLM judges (they call a
model endpoint: no network on nodes, and a judge's verdict is not reproducible by validators), rewards that
need a runtime (a sandbox verifiers would provision), and per-task system prompts (the run's system prompt
is one pinned setting). Hub ids (`owner/name@version`) are not fetched: the taskset's package must be
installed.

The identity's package is the distribution that provides the taskset module (verifiers itself when the
module is not installed as one), and its content hash covers the taskset id, its configuration, verifiers'
version, every task's data, and the module's source when no distribution pins it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any

from ...p2p.signing import canonical_json
from ..errors import TaskError
from .environment import EnvironmentIdentity, ScoringLimits
from .registry import split_args
from .types import MAX_ANSWER_CHARS, MAX_PROMPT_CHARS, Task, check_index
from .verifier import MAX_COMPLETION_CHARS

NAME = "verifiers"
PACKAGE = "verifiers"
TASK_TYPE = "verifiers"
SCHEME = "prime-node/verifiers/v1"
MAX_TASKS = 1_000_000
# verifiers imports an LLM-client stack (openai, anthropic, mcp): about 500 MiB of address space at rest.
LIMITS = ScoringLimits(isolation="process", wall_s=10.0, cpu_s=10.0, memory_mb=3072)
INSTALL_HINT = "pip install -e '.[verifiers]' (the optional extra: verifiers==0.4.0)"


def _needs_runtime(fn: Any) -> bool:
    """verifiers' own rule: a scoring hook needs a runtime when it takes `runtime` without a default."""
    parameter = inspect.signature(fn).parameters.get("runtime")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _unsupported(task: Any, where: str) -> str | None:
    """Why verifiers task `task` cannot be scored here, or None when it can."""
    cls = type(task)
    if getattr(cls, "NEEDS_CONTAINER", False):
        return f"{where} needs a container"
    if cls.toolsets(task.config):
        return f"{where} uses tool servers (multi-turn)"
    if task.config.judges:
        return f"{where} is scored by LLM judges"
    rewards = task.hooks("reward")
    if not rewards:
        return f"{where} has no rewards"
    needing = [fn.__name__ for fn in (*rewards, *task.hooks("metric")) if _needs_runtime(fn)]
    if needing:
        return f"{where}: rewards or metrics {', '.join(needing)} need a runtime (a sandbox)"
    if task.data.system_prompt:
        return f"{where} has its own system prompt (the run's system prompt is the one setting)"
    return None


def _prompt(data: Any) -> str | None:
    prompt = data.prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and getattr(prompt[0], "role", None) == "user":
        return data.prompt_text
    return None


def _distribution(module_name: str) -> tuple[str, str] | None:
    """(distribution, version) that installed the top-level module `module_name`, when one did."""
    names = importlib.metadata.packages_distributions().get(module_name.split(".")[0], [])
    if len(names) != 1:
        return None
    return names[0], importlib.metadata.version(names[0])


class VerifiersEnvironment:
    """A verifiers taskset's tasks and rewards (see the module docstring). Pickled (for the scoring
    worker) as its configuration: the worker loads the taskset again and must reach the same identity."""

    def __init__(self, taskset_id: str, options: dict[str, str], size: int | None) -> None:
        try:
            import verifiers.v1 as vf
            from verifiers.v1.utils.generic import concrete_type
            from verifiers.v1.utils.loaders import taskset_class
        except ImportError as exc:
            raise TaskError(f"{NAME} needs the optional extra: {INSTALL_HINT} ({exc})") from None
        self.taskset_id, self.options, self.size = taskset_id, dict(options), size
        try:
            cls = taskset_class(taskset_id)
            config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
            self._config = config_cls.model_validate({**options, "id": taskset_id})
            taskset = cls(self._config)
        except (ModuleNotFoundError, AttributeError, TypeError, ValueError) as exc:
            raise TaskError(f"{NAME}: taskset {taskset_id!r} cannot be loaded: {exc}") from None
        if cls.toolsets(self._config):
            raise TaskError(f"{NAME}: taskset {taskset_id!r} uses shared tool servers (multi-turn)")
        if size is None and not taskset.bounded:
            raise TaskError(f"{NAME}: taskset {taskset_id!r} never ends; give size=N")
        limit = min(size or MAX_TASKS, MAX_TASKS)
        self._tasks: list[tuple[Any, Task]] = []
        for task in taskset.take(limit + 1) if size is None else taskset.take(limit):
            self._tasks.append(self._check(task, len(self._tasks)))
        if len(self._tasks) > limit:
            raise TaskError(f"{NAME}: taskset {taskset_id!r} has more than {MAX_TASKS} tasks; give size=N")
        if not self._tasks:
            raise TaskError(f"{NAME}: taskset {taskset_id!r} has no tasks")
        self._identity = self._make_identity(cls)

    def _check(self, task: Any, index: int) -> tuple[Any, Task]:
        where = f"{NAME}: taskset {self.taskset_id!r}, task {index}"
        reason = _unsupported(task, where)
        if reason is not None:
            raise TaskError(reason)
        prompt, answer = _prompt(task.data), getattr(task.data, "answer", None)
        if prompt is None or not 1 <= len(prompt) <= MAX_PROMPT_CHARS:
            raise TaskError(
                f"{where}: its prompt is not one text or user message of 1..{MAX_PROMPT_CHARS} characters"
            )
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = json.dumps(answer)
        if not isinstance(answer, str) or not 1 <= len(answer) <= MAX_ANSWER_CHARS:
            raise TaskError(f"{where}: it has no reference `answer` of 1..{MAX_ANSWER_CHARS} characters")
        metadata = canonical_json({"index": index}).decode()
        return task, Task(prompt=prompt, answer=answer, task_type=TASK_TYPE, metadata=metadata)

    def _make_identity(self, cls: type) -> EnvironmentIdentity:
        module = sys.modules[cls.__module__]
        distribution = _distribution(cls.__module__)
        document: dict[str, Any] = {
            "scheme": SCHEME,
            "taskset": self.taskset_id,
            "config": self._config.model_dump(mode="json"),
            "size": self.size,
            "verifiers": importlib.metadata.version(PACKAGE),
            "tasks": hashlib.sha256(
                b"".join(canonical_json(t.data.model_dump(mode="json")) for t, _ in self._tasks)
            ).hexdigest(),
            "limits": LIMITS.model_dump(),
        }
        if distribution is None:  # a module on the path, not installed: its source is what pins it
            document["source"] = hashlib.sha256(Path(module.__file__ or "").read_bytes()).hexdigest()
        package, version = distribution or (PACKAGE, importlib.metadata.version(PACKAGE))
        digest = "sha256:" + hashlib.sha256(canonical_json(document)).hexdigest()
        return EnvironmentIdentity(name=NAME, package=package, version=version, content_hash=digest)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "taskset_id": self.taskset_id,
            "options": self.options,
            "size": self.size,
            "identity": self._identity,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["taskset_id"], state["options"], state["size"])  # type: ignore[misc]
        if self._identity != state["identity"]:
            raise TaskError(f"{NAME}: taskset {self.taskset_id!r} loads differently in the scoring worker")

    @property
    def spec(self) -> str:
        extra = [f"size={self.size}"] if self.size is not None else []
        return f"{NAME}:" + ",".join(
            [f"taskset={self.taskset_id}", *extra, *(f"{k}={v}" for k, v in sorted(self.options.items()))]
        )

    @property
    def identity(self) -> EnvironmentIdentity:
        return self._identity

    @property
    def scoring(self) -> ScoringLimits:
        return LIMITS

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, index: int) -> Task:
        check_index(index, len(self._tasks), self.spec)
        return self._tasks[index][1]

    def score(self, completion: str, task: Task) -> float:
        """The weighted mean of the verifiers task's rewards for `completion`, clipped to [0, 1]; never raises."""
        if not isinstance(completion, str) or len(completion) > MAX_COMPLETION_CHARS:
            return 0.0
        try:
            return _score(self._tasks[json.loads(task.metadata)["index"]][0], completion)
        except Exception:  # noqa: BLE001 (a taskset's reward on a peer's text: anything it raises is a 0)
            return 0.0


def _score(task: Any, completion: str) -> float:
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask
    from verifiers.v1.types import AssistantMessage, UserMessage

    trace = vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data),
        agent=AgentInfo(config=vf.AgentConfig()),
        nodes=[
            MessageNode(message=UserMessage(content=task.data.prompt_text)),
            MessageNode(parent=0, message=AssistantMessage(content=completion), sampled=True),
        ],
    )
    asyncio.run(task.score(trace))
    rewards = list(trace.rewards.values())
    if not rewards or any(r is None for r in rewards):
        return 0.0  # a reward that did not run (verifiers records None when scoring failed midway)
    total = sum(r.weight for r in rewards)
    value = sum(r.score * r.weight for r in rewards) / total if total > 0 else 0.0
    return min(max(value, 0.0), 1.0) if math.isfinite(value) else 0.0


def open_verifiers(args: str, *, seed: int = 0) -> VerifiersEnvironment:
    """Single-turn tasksets of the verifiers library (optional extra), scored by their own rewards."""
    options = split_args(NAME, args)
    dotted = [key for key in options if "." in key]
    if dotted:
        raise TaskError(f"{NAME}: option {dotted[0]!r}: a taskset's options have no '.'")
    taskset_id = options.pop("taskset", "")
    if not taskset_id:
        raise TaskError(f"{NAME}: name the taskset: verifiers:taskset=ID")
    if "/" in taskset_id or "@" in taskset_id:
        raise TaskError(
            f"{NAME}: hub ids are not fetched; install the taskset's package and give its module name"
        )
    size_text = options.pop("size", None)
    if size_text is not None and not (size_text.isdigit() and 1 <= int(size_text) <= MAX_TASKS):
        raise TaskError(f"{NAME}: size must be an integer in 1..{MAX_TASKS}, got {size_text!r}")
    return VerifiersEnvironment(taskset_id, options, int(size_text) if size_text else None)
