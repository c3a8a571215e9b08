"""The `filtered` environment: the tasks of another environment that offline difficulty filtering kept.

`prime-node tasks filter --env SPEC --out FILE` (difficulty.py) writes the kept tasks as a task file whose
rows also name their `source` (the environment's spec, the same in every row) and `source_index` (the task's
index there). `--env filtered:FILE` reopens exactly those tasks of that environment: task i is the source's
task `source_index` of row i, scored by the source's own scorer within the source's ScoringLimits. So
filtering works for every environment, also those whose tasks a task file cannot score on its own (a
puzzle family's checker needs its configuration; `file:FILE` would refuse their task types).

Opening checks every row against the source: its index must exist there and its prompt and answer must be
that task's, so a file filtered from another configuration (another seed, another version that generates
other tasks) stops the run at start-up naming the row, instead of training on tasks nobody scores alike.
The identity is the source's name, package and version (what to install is the source's) with a content
hash of the source's hash and the kept indices.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import TaskError
from .environment import Environment, EnvironmentIdentity, ScoringLimits
from .files import read_rows
from .registry import content_hash, open_environment, parse_spec, path_arg, split_args
from .types import Task, check_index

NAME = "filtered"
_OPTIONAL = {"source": "string", "source_index": "integer", "task_type": "string", "metadata": "string"}


class FilteredEnvironment:
    """`indices` of `source`, in this order."""

    def __init__(self, path: Path, source: Environment, indices: list[int]) -> None:
        self.path = path
        self.source = source
        self.indices = indices
        digest = content_hash({"filtered_from": source.identity.content_hash, "indices": indices})
        self._identity = source.identity.model_copy(update={"content_hash": digest})

    @property
    def spec(self) -> str:
        return f"{NAME}:{path_arg(NAME, self.path)}"

    @property
    def identity(self) -> EnvironmentIdentity:
        return self._identity

    @property
    def scoring(self) -> ScoringLimits:
        return self.source.scoring

    def __len__(self) -> int:
        return len(self.indices)

    def source_index(self, index: int) -> int:
        """The index in the source of task `index` here."""
        check_index(index, len(self.indices), self.path)
        return self.indices[index]

    def get(self, index: int) -> Task:
        return self.source.get(self.source_index(index))

    def score(self, completion: str, task: Task) -> float:
        return self.source.score(completion, task)


def open_filtered(args: str, *, seed: int = 0) -> FilteredEnvironment:
    """The tasks of another environment that `prime-node tasks filter` kept: `filtered:FILE`."""
    given = split_args(NAME, args, positional="path", known=["path"]).get("path")
    if given is None:
        raise TaskError(f"{NAME}: give the filtered task file's path, as {NAME}:FILE")
    path, _, numbered = read_rows(given, _OPTIONAL)
    sources = {values.get("source") for _, values in numbered}
    if len(sources) != 1 or not isinstance(next(iter(sources)), str):
        shown = ", ".join(sorted(repr(s)[:80] for s in sources))
        raise TaskError(
            f"{path}: column 'source' must name the one environment the file was filtered from in every row "
            f"(found {shown}); write it with prime-node tasks filter --env SPEC"
        )
    spec = str(next(iter(sources)))
    if parse_spec(spec)[0] == NAME:
        raise TaskError(f"{path}: its source {spec!r} is itself filtered; name the original environment")
    source = open_environment(spec, seed=seed)
    indices: list[int] = []
    for row, values in numbered:
        where = f"{path}: row {row}"
        index = values.get("source_index")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(source):
            raise TaskError(
                f"{where}: column 'source_index' must be a task index of {spec} (0..{len(source) - 1})"
            )
        task = source.get(index)
        if values.get("prompt") != task.prompt or str(values.get("answer")) != task.answer:
            raise TaskError(
                f"{where}: task {index} of {spec} has another prompt or answer than the file's: the file was "
                "filtered from another configuration or version of it"
            )
        indices.append(index)
    return FilteredEnvironment(path, source, indices)
