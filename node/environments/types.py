"""What a task is, and the one interface every task set offers (built-in family and local files alike)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

# Bounds shared by the file loader and anything that builds tasks; a prompt the tiny model could never
# read (its context is a few hundred tokens) is still allowed up to this, for real models.
MAX_PROMPT_CHARS = 16_384
MAX_ANSWER_CHARS = 1_024
MAX_TASK_TYPE_CHARS = 64
# A task's scorer data beside its answer (a puzzle's parameters, a program's unit tests).
MAX_METADATA_CHARS = 1024 * 1024


class Task(BaseModel):
    """One problem: the text the model sees, the reference answer, and the verifier that scores it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    prompt: str = Field(
        ..., min_length=1, max_length=MAX_PROMPT_CHARS, description="Text given to the model."
    )
    answer: str = Field(..., min_length=1, max_length=MAX_ANSWER_CHARS, description="Reference final answer.")
    task_type: str = Field(
        ...,
        min_length=1,
        max_length=MAX_TASK_TYPE_CHARS,
        pattern=r"^[a-z][a-z0-9_]*$",
        description="Names the verifier (see verifier.VERIFIERS) that turns a completion into a reward.",
    )
    difficulty: int = Field(0, ge=0, le=100, description="Difficulty level; 0 when unknown (file tasks).")
    metadata: str = Field(
        "{}",
        max_length=MAX_METADATA_CHARS,
        description="Canonical JSON object the environment's scorer needs besides the answer; {} when none.",
    )


@runtime_checkable
class TaskSet(Protocol):
    """A finite, indexable collection of tasks; the same index always gives the same task.

    Contributors pick indices with a seeded PRNG and validators re-derive them, so `get` must be a pure
    function of the index (and the set's own seed or file), never of call order.
    """

    @property
    def name(self) -> str:
        """A short, stable description of where the tasks come from (logged and recorded with models)."""
        ...

    @property
    def identity(self) -> str:
        """What peers compare to know they draw the same tasks: the same on every machine that holds the
        same tasks, whatever the local path (the run's operator announces it: docs/protocol.md)."""
        ...

    def __len__(self) -> int: ...

    def get(self, index: int) -> Task:
        """The task at `index`, 0 <= index < len(self); raises TaskError otherwise."""
        ...
