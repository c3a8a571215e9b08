"""What a task is: what an environment (environment.py) gives for an index."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..errors import TaskError

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
        description="The kind of task; in task files it names the scorer (verifier.py) that turns a completion "
        "into a reward.",
    )
    difficulty: int = Field(0, ge=0, le=100, description="Difficulty level; 0 when unknown (file tasks).")
    metadata: str = Field(
        "{}",
        max_length=MAX_METADATA_CHARS,
        description="Canonical JSON object the environment's scorer needs besides the answer; {} when none.",
    )


def check_index(index: object, count: int, where: object) -> int:
    """`index` when it is an int (not a bool) in [0, count); TaskError naming `where` otherwise. Indices come
    from a seeded PRNG on one side and from a peer's rollout file on the other."""
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise TaskError(f"task index {index!r} is out of range for {where} (0..{count - 1})")
    return index
