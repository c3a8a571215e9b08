"""Offline difficulty filtering: estimate each task's pass rate with a model, keep those in a band.

INTELLECT-2 (section 3.1) found this decisive for learning: tasks the model always solves or never
solves give groups whose rewards are all equal, hence all-zero advantages, and are thrown away by the
trainer's online filter after costing a whole generation. Filtering once, offline, removes them first.

Works for every environment: completions are scored by the environment's own scorer, bounded as it
says (rewards.py), and a task passes when it scores 1.0. Each task gets k completions sampled with the
engine's Gumbel-max sampler; sample j of task i uses the seed SHA-256("prime-node/difficulty/v1" || seed
|| i || j) (first 8 bytes, top bit cleared), so the same command on any machine gives the same estimates.
The estimate is the pass rate c / k (the unbiased pass@1 estimate from k samples); the band is applied to
it, so with k = 8 the default band [0.125, 0.5] keeps tasks solved 1 to 4 times out of 8.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, model_validator

from ..config import CommonSettings
from ..engine import EngineSettings
from ..engine.types import InferenceEngine, SampleRequest, SamplingParams
from ..errors import TaskError
from ..run.prompts import PromptBuilder
from .environment import Environment
from .files import JSONL_SUFFIXES, PARQUET_SUFFIXES
from .filtered import FilteredEnvironment
from .rewards import EnvironmentScorer
from .types import Task

if TYPE_CHECKING:  # `prime-node tasks filter` builds its flags from FilterSettings: no transformers at load
    from transformers import PreTrainedTokenizerBase

_DOMAIN = b"prime-node/difficulty/v1\x00"
MAX_SEED = 2**63 - 1


def sample_seed(seed: int, index: int, j: int) -> int:
    """The Gumbel seed of sample j of task `index`: a pure function of its arguments."""
    digest = hashlib.sha256(_DOMAIN + struct.pack(">QQQ", seed, index, j)).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED


class FilterSettings(CommonSettings):
    """Settings of `prime-node tasks filter`."""

    engine: EngineSettings = Field(default_factory=EngineSettings, description="Inference engine.")
    k: int = Field(8, ge=1, le=1024, description="Completions sampled per task.")
    min_pass: float = Field(0.125, ge=0.0, le=1.0, description="Lowest pass rate kept (inclusive).")
    max_pass: float = Field(0.5, ge=0.0, le=1.0, description="Highest pass rate kept (inclusive).")
    max_new_tokens: int = Field(64, ge=1, le=8192, description="Most tokens generated per completion.")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature (use the run's).")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the sampling noise.")
    task_seed: int = Field(
        0, ge=0, le=MAX_SEED, description="Seed of generated environments unless the spec gives one."
    )
    offset: int = Field(0, ge=0, description="First task index to estimate.")
    limit: int | None = Field(
        None,
        ge=1,
        le=2_000_000,
        description="Tasks to estimate; default all (required for the built-in set).",
    )

    @model_validator(mode="after")
    def _band(self) -> FilterSettings:
        if self.min_pass > self.max_pass:
            raise ValueError(f"min ({self.min_pass}) must not exceed max ({self.max_pass})")
        return self


@dataclass(frozen=True)
class TaskEstimate:
    index: int  # position of the task in its environment
    task: Task
    passes: int  # completions the verifier scored 1.0
    k: int

    @property
    def pass_rate(self) -> float:
        return self.passes / self.k


def estimate_pass_rates(
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    environment: Environment,
    indices: Sequence[int],
    *,
    k: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    tasks_per_batch: int = 8,
    progress: Callable[[int], None] | None = None,
    system_prompt: str = "",
) -> list[TaskEstimate]:
    """k seeded completions per task, scored by the environment; `progress(n)` after n more tasks.
    Prompts are built as in the run (`system_prompt`: the run's, for a chat model)."""
    if k < 1 or tasks_per_batch < 1:
        raise TaskError("k and tasks_per_batch must be >= 1")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    scorer = EnvironmentScorer(environment)
    # The prompts a run gives this model (node/run/prompts.py): raw text, or its chat template's user turn.
    prompts = PromptBuilder(tokenizer, system_prompt=system_prompt)
    out: list[TaskEstimate] = []
    for start in range(0, len(indices), tasks_per_batch):
        chunk = [(i, environment.get(i)) for i in indices[start : start + tasks_per_batch]]
        requests = []
        for i, task in chunk:
            prompt = prompts.ids(task.prompt)
            requests += [SampleRequest(prompt_ids=prompt, seed=sample_seed(seed, i, j)) for j in range(k)]
        # No hidden states: nothing here is proved, and capturing them costs memory per token.
        completions = engine.generate(requests, params, capture_hidden=False)
        for n, (i, task) in enumerate(chunk):
            mine = completions[n * k : (n + 1) * k]
            texts = [str(tokenizer.decode(list(c.output_ids), skip_special_tokens=True)) for c in mine]
            passes = sum(1 for t in texts if scorer(t, task) == 1.0)
            out.append(TaskEstimate(i, task, passes, k))
        if progress is not None:
            progress(len(chunk))
    return out


def in_band(estimates: Sequence[TaskEstimate], low: float, high: float) -> list[TaskEstimate]:
    """Estimates with low <= pass rate <= high (both ends included, so 1/8 and 4/8 are kept for k = 8)."""
    if not 0.0 <= low <= high <= 1.0:
        raise TaskError(f"need 0 <= min <= max <= 1, got min {low} and max {high}")
    eps = 1e-12  # c / k is compared to decimal bounds such as 0.125; keep exact fractions inside
    return [e for e in estimates if low - eps <= e.pass_rate <= high + eps]


def histogram(estimates: Sequence[TaskEstimate], k: int) -> list[int]:
    """counts[c] = tasks solved c times out of k, for c = 0..k."""
    counts = [0] * (k + 1)
    for e in estimates:
        counts[e.passes] += 1
    return counts


def render_histogram(counts: Sequence[int], k: int, low: float, high: float, width: int = 40) -> str:
    """A text histogram of passes out of k; rows inside the band are marked with '*'."""
    most = max(counts, default=0) or 1
    lines = [f"passes/{k}  tasks"]
    for c, n in enumerate(counts):
        mark = "*" if low - 1e-12 <= c / k <= high + 1e-12 else " "
        bar = "#" * round(width * n / most)
        lines.append(f"{mark} {c:>3}/{k:<3} {n:>6}  {bar}")
    return "\n".join(lines)


def write_task_file(path: Path, estimates: Sequence[TaskEstimate], environment: Environment) -> None:
    """Write the kept tasks of `environment` as JSONL or Parquet (by suffix): a file `filtered:PATH` reopens
    as those tasks of that environment, scored by it (filtered.py), and `file:PATH` reads as a task file
    where its task types need nothing but the row (arithmetic, integer, exact, math, code).

    `source` (the environment's spec) and `source_index` say where each task came from, `pass_rate` why it
    was kept; the task-file loader ignores them. A filtered environment's tasks are written as those of its
    own source, so filtering again narrows the set instead of nesting files. Written to a temporary file,
    then renamed, so a crash leaves no half-written task file behind.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in PARQUET_SUFFIXES + JSONL_SUFFIXES:
        allowed = ", ".join(PARQUET_SUFFIXES + JSONL_SUFFIXES)
        raise TaskError(f"output {path}: unknown format {suffix or '(no suffix)'!r}; use one of {allowed}")
    if not estimates:
        raise TaskError(
            f"no task has a pass rate in the band, so {path} would be empty (the loader refuses empty "
            "files); widen --min/--max, raise --k or filter more tasks"
        )
    origin: Callable[[int], int] = lambda index: index  # noqa: E731
    if isinstance(environment, FilteredEnvironment):
        origin = environment.source_index
        environment = environment.source
    records = [
        {
            "prompt": e.task.prompt,
            "answer": e.task.answer,
            "task_type": e.task.task_type,
            "metadata": e.task.metadata,
            "source": environment.spec,
            "source_index": origin(e.index),
            "pass_rate": e.pass_rate,
        }
        for e in estimates
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if suffix in PARQUET_SUFFIXES:
            pq.write_table(pa.Table.from_pylist(records), tmp)
        else:
            tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
